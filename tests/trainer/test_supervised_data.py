"""Supervised data: the files users have, their row shapes, and the loss mask on the
assistant's tokens, checked against a real chat template's rendering."""

from __future__ import annotations

import json

import pytest

from rollwire.services.core.datasets import read_rows
from rollwire.trainer.batching import pack
from rollwire.trainer.pipelines.data import (
    Rendered,
    conversation_of,
    distill_examples,
    held_out_split,
    preference_examples,
    preference_of,
    render,
    supervised_examples,
)

ROWS = [
    {"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]},
    {"prompt": "4+4", "completion": "8"},
]


def spans(tokenizer, rendered: Rendered) -> list[str]:
    """The trained tokens, decoded, one string per contiguous run."""
    out, run = [], []
    for token, trained in zip(rendered.ids, rendered.mask, strict=True):
        if trained:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    if run:
        out.append(tokenizer.decode(run))
    return out


def test_a_multi_turn_chat_is_trained_on_the_assistant_turns_only(smollm2_tokenizer) -> None:
    tokenizer = smollm2_tokenizer
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 5 + 7?"},
        {"role": "assistant", "content": "5 + 7 = 12."},
    ]
    rendered = render(tokenizer, messages)
    # Token for token the template's own rendering of the whole conversation.
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # The loss covers each assistant turn as the model must write it, end of turn
    # included, and nothing of the system, user or role headers.
    assert spans(tokenizer, rendered) == ["2 + 3 = 5.<|im_end|>\n", "5 + 7 = 12.<|im_end|>\n"]
    # Without a system message the template inserts its own; still only the answers train.
    short = render(tokenizer, messages[1:3])
    assert tokenizer.decode(short.ids).startswith("<|im_start|>system\nYou are a helpful")
    assert spans(tokenizer, short) == ["2 + 3 = 5.<|im_end|>\n"]


def test_a_template_that_rewrites_past_turns_is_refused(smollm2_tokenizer) -> None:
    class Rewriting:
        """The SmolLM2 tokenizer, but earlier assistant turns render shortened."""

        chat_template = "x"
        is_fast = True
        eos_token_id = smollm2_tokenizer.eos_token_id

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            last = len(messages) - 1
            shown = [
                {**m, "content": m["content"][:1]} if m["role"] == "assistant" and i < last else m
                for i, m in enumerate(messages)
            ]
            return smollm2_tokenizer.apply_chat_template(
                shown, tokenize=False, add_generation_prompt=add_generation_prompt
            )

        def __call__(self, *args, **kwargs):
            return smollm2_tokenizer(*args, **kwargs)

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "long answer"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "another"},
    ]
    with pytest.raises(ValueError, match="turn 1 differently"):
        render(Rewriting(), messages, where="row 7")


def test_without_a_template_the_completion_and_eos_train(tiny_model_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert tokenizer.chat_template is None
    rendered = render(tokenizer, conversation_of({"prompt": "4+4=", "completion": "8"}, "r"))
    prompt = tokenizer("4+4=", add_special_tokens=False)["input_ids"]
    answer = tokenizer("8", add_special_tokens=False)["input_ids"]
    assert rendered.ids == prompt + answer + [tokenizer.eos_token_id]
    assert rendered.mask == [0] * len(prompt) + [1] * (len(answer) + 1)


def test_rows_are_read_from_jsonl_parquet_and_saved_datasets(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = tmp_path / "data.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "completion": "b"}]), tmp_path / "d.parquet"
    )
    assert list(read_rows(lines)) == ROWS
    assert list(read_rows(tmp_path / "d.parquet")) == [{"prompt": "a", "completion": "b"}]
    datasets = pytest.importorskip("datasets", reason="datasets writes save_to_disk folders")
    saved = datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}] * 3)
    saved.save_to_disk(str(tmp_path / "saved"))
    assert list(read_rows(tmp_path / "saved")) == [{"prompt": "a", "completion": "b"}] * 3
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "both"))
    with pytest.raises(ValueError, match="holds a DatasetDict; point at one of its splits"):
        list(read_rows(tmp_path / "both"))
    assert list(read_rows(tmp_path / "both" / "train")) == [{"prompt": "a", "completion": "b"}] * 3


def test_row_shapes_and_their_errors() -> None:
    assert conversation_of(ROWS[1], "r") == [
        {"role": "user", "content": "4+4"},
        {"role": "assistant", "content": "8"},
    ]
    pair = preference_of({"prompt": "2+2", "chosen": "4", "rejected": "5"}, "r")
    assert pair.chosen == [{"role": "assistant", "content": "4"}]
    listed = preference_of(
        {"prompt": [{"role": "user", "content": "2+2"}], "chosen": "4", "rejected": "5"}, "r"
    )
    assert listed.prompt == pair.prompt
    with pytest.raises(ValueError, match="needs 'messages', or 'prompt' and 'completion'"):
        conversation_of({"text": "x"}, "row 3")
    with pytest.raises(ValueError, match="no assistant message"):
        conversation_of({"messages": [{"role": "user", "content": "x"}]}, "row 3")
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        conversation_of({"messages": [{"role": "bot", "content": "x"}]}, "row 3")
    with pytest.raises(ValueError, match=r"missing \['rejected'\]"):
        preference_of({"prompt": "a", "chosen": "b"}, "row 3")


def test_long_rows_are_truncated_or_left_out_and_counted(tiny_model_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [
        {"prompt": "1+1=", "completion": "2"},  # 6 tokens
        {"prompt": "1234+1=", "completion": "1235"},  # 12 tokens: cut to 10
        {"prompt": "1234567890123456+1=", "completion": "7"},  # answer beyond 10
    ]
    kept, counts = supervised_examples(rows, tokenizer, max_length=10)
    assert (counts.rows, counts.kept, counts.truncated, counts.nothing_to_train) == (3, 2, 1, 1)
    assert all(len(example.ids) <= 10 for example in kept)
    assert kept[1].ids == tokenizer("1234+1=123", add_special_tokens=False)["input_ids"]
    strict, counts = supervised_examples(rows, tokenizer, max_length=10, truncate=False)
    assert len(strict) == 1 and counts.too_long == 2
    assert "1 of 3 rows kept" in counts.summary()


def test_held_out_split_and_packing_are_deterministic() -> None:
    items = list(range(10))
    train, held = held_out_split(items, 0.2, seed=3)
    assert sorted(train + held) == items and len(held) == 2
    assert held_out_split(items, 0.2, seed=3) == (train, held)
    assert held_out_split(items, 0.2, seed=4) != (train, held)
    assert len(held_out_split(items, 0.01, seed=0)[1]) == 1  # never zero when asked for some
    # First fit in order within 9 tokens: 5 + 4, 3 (+ 2), 9 alone.
    assert pack([5, 4, 3, 9, 2], 9) == [[0, 1], [2, 4], [3]]


def test_a_preference_pair_trains_its_responses_not_the_prompts_answers(
    smollm2_tokenizer,
) -> None:
    tokenizer = smollm2_tokenizer
    row = {
        "prompt": [
            {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": "5."},
            {"role": "user", "content": "And 5 + 7?"},
        ],
        "chosen": "12.",
        "rejected": "13.",
    }
    (pair,), counts = preference_examples([row], tokenizer, max_length=512)
    chosen, rejected = pair
    assert spans(tokenizer, chosen) == ["12.<|im_end|>\n"]
    assert spans(tokenizer, rejected) == ["13.<|im_end|>\n"]
    # The same prompt tokens before each response.
    prompt = chosen.mask.index(1)
    assert chosen.ids[:prompt] == rejected.ids[:prompt] and counts.kept == 1


def test_token_level_rows_become_sequences_with_their_teachers_top_k() -> None:
    row = {
        "prompt": "1 + 1 =",
        "completion": "2",
        "prompt_ids": [5, 6, 7],
        "completion_ids": [8, 1],
        "top_ids": [[8, 9], [1, 4]],
        "top_logprobs": [[-0.1, -2.5], [-0.01, -5.0]],
    }
    (example,), counts = distill_examples([row], max_length=16)
    assert example.ids == [5, 6, 7, 8, 1] and example.mask == [0, 0, 0, 1, 1]
    assert example.top_ids.tolist() == [[0, 0], [0, 0], [0, 0], [8, 9], [1, 4]]
    assert example.top_logprobs[3].tolist() == pytest.approx([-0.1, -2.5])
    (cut,), counts = distill_examples([row], max_length=4)
    assert cut.ids == [5, 6, 7, 8] and counts.truncated == 1 and cut.top_ids.shape == (4, 2)
    assert distill_examples([row], max_length=4, truncate=False)[1].too_long == 1
    with pytest.raises(ValueError, match="row 0: a KL loss .* has no top_ids, top_logprobs"):
        distill_examples([{"prompt_ids": [5], "completion_ids": [8]}], 16)
    with pytest.raises(ValueError, match="row 0: its token ids are the teacher's tokenizer's"):
        distill_examples([{**row, "tokenizer": "a" * 64}], 16, tokenizer_digest="b" * 64)
    assert distill_examples([{**row, "tokenizer": "a" * 64}], 16, tokenizer_digest="a" * 64)[0]
    with pytest.raises(ValueError, match="row 0: 1 top-k rows for 2 completion tokens"):
        distill_examples([{**row, "top_ids": [[8, 9]], "top_logprobs": [[-0.1, -2.5]]}], 16)


def test_token_level_rows_from_image_prompts_find_their_images_pad_tokens(tiny_vlm_path) -> None:
    from rollwire.services.core.images import row_value
    from rollwire.services.core.vision import VisionSide
    from tests.helpers.vision import digit_images

    side = VisionSide(tiny_vlm_path)
    (picture, _), (other, _) = digit_images(2)
    prompt, _ = side.prompt_ids([picture], [40, 41])  # start, four pads, end, then text
    row = {
        "prompt_ids": prompt,
        "completion_ids": [8, 1],
        "top_ids": [[8, 9], [1, 4]],
        "top_logprobs": [[-0.1, -2.5], [-0.01, -5.0]],
        "images": [row_value(picture)],
    }
    (example,), _ = distill_examples([row], 64, vision=side)
    (image,) = example.images
    assert image.data == picture.data and image.offset == prompt.index(side.image_token)
    # Too long with an image: left out, never cut through the image.
    assert distill_examples([row], 5, vision=side)[1].too_long == 1
    with pytest.raises(ValueError, match="row 0: the tokens hold 1 image.s. for 2 given"):
        distill_examples(
            [{**row, "images": [row_value(picture), row_value(other)]}], 64, vision=side
        )
    short = [token for i, token in enumerate(prompt) if i != image.offset]  # a pad dropped
    with pytest.raises(ValueError, match="image 0 has 3 pad tokens where the model reads it as 4"):
        distill_examples([{**row, "prompt_ids": short}], 64, vision=side)
    with pytest.raises(ValueError, match="shows images, but the model is not a vision-language"):
        distill_examples([row], 64)


def test_preference_rows_show_their_images_on_both_sides(tiny_vlm_path) -> None:
    from transformers import AutoTokenizer

    from rollwire.services.core.images import row_value
    from rollwire.services.core.vision import VisionSide
    from tests.helpers.vision import digit_images

    side, tokenizer = VisionSide(tiny_vlm_path), AutoTokenizer.from_pretrained(tiny_vlm_path)
    (picture, _), _ = digit_images(2)
    row = {"prompt": "Which?", "chosen": "3", "rejected": "4", "images": [row_value(picture)]}
    ((chosen, rejected),), counts = preference_examples([row], tokenizer, 64, vision=side)
    assert counts.kept == 1 and chosen.images == rejected.images
    (image,) = chosen.images
    for one in (chosen, rejected):
        pads = [i for i, token in enumerate(one.ids) if token == side.image_token]
        assert pads == list(range(image.offset, image.offset + 4))  # the model's four
        assert not any(one.mask[i] for i in pads)
        side.check(one.ids, list(one.images))
    assert chosen.ids[: image.offset + 4] == rejected.ids[: image.offset + 4]
    assert preference_examples([row], tokenizer, 8, vision=side)[1].too_long == 1
    with pytest.raises(ValueError, match="row 0 shows images, but the model is not"):
        preference_examples([row], tokenizer, 64)
