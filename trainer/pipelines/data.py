"""Supervised data from the files users have: chat conversations, prompt/completion pairs
and preference pairs, turned into token ids with a mask that is 1 on the tokens a loss
is taken on (the assistant's), by the model's own chat template.

Rows come from `rollwire.services.core.datasets.read_rows` (JSONL, Parquet, or a
`save_to_disk` folder). The shapes:

- `{"messages": [{"role": ..., "content": ...}, ...]}`: system, user and assistant
  turns, any number; every assistant turn is trained.
- `{"prompt": ..., "completion": ...}`: each a string (a user turn, an assistant turn)
  or a list of messages.
- `{"prompt": ..., "chosen": ..., "rejected": ...}`: a preference pair, the same way.
- `{"prompt_ids": [...], "completion_ids": [...], "top_ids": [[...], ...],
  "top_logprobs": [[...], ...]}`: token-level distillation rows (`rollwire distill
  generate` with distill.top_k): token ids as the teacher saw them, and for each
  completion token the teacher's k most likely tokens and their logprobs
  (`distill_examples`; the text fields they also carry are not read).

With a chat template, each assistant turn's tokens are found by rendering the
conversation up to it twice (without it, ending in the generation prompt; with it):
what the second adds is the turn as the model is asked to produce it, end-of-turn
marker included, and its characters are mapped to tokens by the tokenizer's offsets.
A template that renders a turn differently once later turns follow (some drop past
reasoning) cannot be trained this way, and is refused with the conversation named.
Without a template the contents are concatenated, the end-of-sequence token after the
last assistant turn.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollwire.services.core.images import ImageError, ImageRef, images_of

Message = dict[str, str]
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Rendered:
    """One sequence: its token ids and, per token, 1 where the loss is taken."""

    ids: list[int]
    mask: list[int]
    images: tuple[ImageRef, ...] = ()
    """The images the sequence shows, each with the offset of its placeholders."""

    @property
    def trained(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Preference:
    """A preference pair: one prompt (a conversation so far), two continuations."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]


def messages_of(value: Any, where: str, role: str) -> list[Message]:
    """`value` as messages: a string is one message of `role`; a list must hold
    {role, content} mappings with known roles and string contents."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a string or a non-empty list of messages")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(f"{where}[{index}]: a message needs 'role' and 'content'")
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}[{index}]: unknown role {message['role']!r}; use one of {list(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(f"{where}[{index}]: content must be a string")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def conversation_of(row: dict[str, Any], where: str) -> list[Message]:
    """The conversation of a `messages` or `prompt`/`completion` row."""
    if "messages" in row:
        messages = messages_of(row["messages"], f"{where}.messages", "user")
    elif "prompt" in row and "completion" in row:
        messages = messages_of(row["prompt"], f"{where}.prompt", "user") + messages_of(
            row["completion"], f"{where}.completion", "assistant"
        )
    else:
        raise ValueError(
            f"{where}: a supervised row needs 'messages', or 'prompt' and 'completion' "
            f"(it has {sorted(row)})"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: no assistant message to train on")
    return messages


def preference_of(row: dict[str, Any], where: str) -> Preference:
    """The pair of a `prompt`/`chosen`/`rejected` row."""
    missing = {"prompt", "chosen", "rejected"} - set(row)
    if missing:
        raise ValueError(
            f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected' "
            f"(missing {sorted(missing)})"
        )
    return Preference(
        prompt=messages_of(row["prompt"], f"{where}.prompt", "user"),
        chosen=messages_of(row["chosen"], f"{where}.chosen", "assistant"),
        rejected=messages_of(row["rejected"], f"{where}.rejected", "assistant"),
    )


def _template_text(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def render(
    tokenizer: Any,
    messages: list[Message],
    chat_template: bool | None = None,
    where: str = "",
    train_from: int = 0,
) -> Rendered:
    """`messages` as token ids with the loss on every assistant turn from message
    `train_from` on (a preference pair trains its response, not the prompt's earlier
    answers). `chat_template`: use the tokenizer's (default: when it has one)."""
    use_template = tokenizer.chat_template is not None if chat_template is None else chat_template
    if not use_template:
        return _render_plain(tokenizer, messages, train_from)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("rendering with a chat template needs a fast tokenizer (offsets)")
    text = _template_text(tokenizer, messages, generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < train_from:
            continue
        before = _template_text(tokenizer, messages[:index], generation_prompt=True)
        through = _template_text(tokenizer, messages[: index + 1], generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"{where or 'a conversation'}: the chat template renders assistant turn "
                f"{index} differently once later turns follow; it cannot be trained turn "
                "by turn (set chat_template: false, or train on the final turn only)"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start <= first < end for start, end in spans))
        for first, _ in encoded["offset_mapping"]
    ]
    return Rendered(list(encoded["input_ids"]), mask)


def _render_plain(tokenizer: Any, messages: list[Message], train_from: int = 0) -> Rendered:
    ids: list[int] = []
    mask: list[int] = []
    last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
    for index, message in enumerate(messages):
        piece = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        trained = message["role"] == "assistant" and index >= train_from
        if index == last and tokenizer.eos_token_id is not None:
            piece = [*piece, int(tokenizer.eos_token_id)]
        ids += piece
        mask += [int(trained)] * len(piece)
    return Rendered(ids, mask)


@dataclass
class Counts:
    """What building a dataset kept and why it left rows out."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
    """Kept, cut to max_length (the loss on what is left)."""
    too_long: int = 0
    """Left out: longer than max_length with truncation off."""
    nothing_to_train: int = 0
    """Left out: no trained token within max_length."""
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.kept} of {self.rows} rows kept ({self.truncated} truncated), "
            f"{self.too_long} longer than max_length left out, "
            f"{self.nothing_to_train} without a trained token left out"
        )


def supervised_examples(
    rows: Iterable[dict[str, Any]],
    tokenizer: Any,
    max_length: int,
    truncate: bool = True,
    chat_template: bool | None = None,
    vision: Any = None,
    folder: Path | None = None,
) -> tuple[list[Rendered], Counts]:
    """Renders every row (`conversation_of`, `render`); longer ones are cut to
    `max_length` tokens when `truncate`, else left out; returns them and the counts.

    A row's `images` (paths from `folder`, URIs or base64 data: `images_of`) are shown
    at the start of its first user message, as a chat template writes them, each
    placeholder then made as many pad tokens as `vision` (the model's `VisionSide`)
    reads the image as; a sequence is never cut inside them (too long: left out)."""
    counts, examples = Counts(), []
    for number, row in enumerate(rows):
        counts.rows += 1
        where = f"row {number}"
        messages = conversation_of(row, where)
        images = _row_images(row, vision, folder, where)
        if images:
            messages = _shown_first(messages, vision.marker(tokenizer, len(images)))
        rendered = _expanded(
            render(tokenizer, messages, chat_template, where), images, vision, where
        )
        cut = len(rendered.ids) > max_length
        if cut and (not truncate or images):
            counts.too_long += 1
            continue
        if cut:
            rendered = Rendered(rendered.ids[:max_length], rendered.mask[:max_length])
        if not rendered.trained:
            counts.nothing_to_train += 1
            continue
        examples.append(rendered)
        counts.kept += 1
        counts.truncated += int(cut)
    return examples, counts


def _expanded(rendered: Rendered, images: tuple, vision: Any, where: str) -> Rendered:
    """`rendered` with each image's placeholder made as many pad tokens as the model reads
    the image as (`VisionSide.expand`); as it is without images."""
    if not images:
        return rendered
    try:
        ids, mask, placed = vision.expand(rendered.ids, list(images), rendered.mask)
    except ImageError as error:
        raise ValueError(f"{where}: {error}") from None
    return Rendered(ids, mask, tuple(placed))


def _row_images(row: dict[str, Any], vision: Any, folder: Path | None, where: str) -> tuple:
    if row.get("images") in (None, []):
        return ()
    if vision is None:
        raise ValueError(f"{where} shows images, but the model is not a vision-language one")
    return images_of(row["images"], folder or Path("."), f"{where}.images")


def preference_examples(
    rows: Iterable[dict[str, Any]],
    tokenizer: Any,
    max_length: int,
    truncate: bool = True,
    chat_template: bool | None = None,
    vision: Any = None,
    folder: Path | None = None,
) -> tuple[list[tuple[Rendered, Rendered]], Counts]:
    """Every preference row (`preference_of`) as (chosen, rejected) sequences, each the
    prompt and its response with the loss on the response only; cut or left out at
    `max_length` as `supervised_examples` does (a pair goes whole or not at all). A row's
    `images` are shown at the start of the prompt's first non-system message in both, as
    `supervised_examples` shows them."""
    counts, pairs = Counts(), []
    for number, row in enumerate(rows):
        counts.rows += 1
        where = f"row {number}"
        pair = preference_of(row, where)
        images = _row_images(row, vision, folder, where)
        prompt = (
            _shown_first(pair.prompt, vision.marker(tokenizer, len(images)))
            if images
            else pair.prompt
        )
        sides = []
        for response in (pair.chosen, pair.rejected):
            side = render(tokenizer, prompt + response, chat_template, where, len(prompt))
            sides.append(_expanded(side, images, vision, where))
        cut = any(len(side.ids) > max_length for side in sides)
        if cut and (not truncate or images):
            counts.too_long += 1
            continue
        if cut:
            sides = [Rendered(side.ids[:max_length], side.mask[:max_length]) for side in sides]
        if not all(side.trained for side in sides):
            counts.nothing_to_train += 1
            continue
        pairs.append((sides[0], sides[1]))
        counts.kept += 1
        counts.truncated += int(cut)
    return pairs, counts


def _shown_first(messages: list[Message], marker: str) -> list[Message]:
    """`messages` with `marker` (images' placeholders) before the first non-system
    message's text, as a chat template writes a user turn's images."""
    first = next(i for i, m in enumerate(messages) if m["role"] != "system")
    return [
        {**m, "content": marker + m["content"]} if i == first else m for i, m in enumerate(messages)
    ]


@dataclass(frozen=True)
class Distilled:
    """A token-level distillation sequence: ids, loss mask (the completion), and per
    token the teacher's top-k ids and logprobs (zeros on the prompt)."""

    ids: list[int]
    mask: list[int]
    top_ids: Any  # numpy int64 [len(ids), K]
    top_logprobs: Any  # numpy float32 [len(ids), K]
    images: tuple[ImageRef, ...] = ()
    """The images the prompt shows, each with the offset of its pad tokens."""


def distill_examples(
    rows: Iterable[dict[str, Any]],
    max_length: int,
    truncate: bool = True,
    tokenizer_digest: str | None = None,
    vision: Any = None,
    folder: Path | None = None,
) -> tuple[list[Distilled], Counts]:
    """Token-level distillation rows as sequences (the loss on the completion), cut or
    left out at `max_length` as `supervised_examples` does. A row without the token
    fields, or whose top-k rows do not match its completion, is an error naming it; so
    is one whose `tokenizer` (the teacher's digest) is not `tokenizer_digest` (the
    student's), when both are known. A row's `images` (a vision-language teacher's
    prompt) go where its prompt ids hold their pad tokens (`VisionSide.placed`, with the
    student's `vision`); such a row is left out rather than cut."""
    import numpy as np

    counts, examples, width = Counts(), [], None
    for number, row in enumerate(rows):
        counts.rows += 1
        where = f"row {number}"
        theirs = row.get("tokenizer")
        if tokenizer_digest and theirs and theirs != tokenizer_digest:
            raise ValueError(
                f"{where}: its token ids are the teacher's tokenizer's ({theirs[:12]}), not "
                f"this model's ({tokenizer_digest[:12]}); token-level distillation needs one "
                "tokenizer (for another, distil at the sequence level: sft.loss nll)"
            )
        missing = [
            key
            for key in ("prompt_ids", "completion_ids", "top_ids", "top_logprobs")
            if not isinstance(row.get(key), list)
        ]
        if missing:
            raise ValueError(
                f"{where}: a KL loss trains on the teacher's top-k, and this row has no "
                f"{', '.join(missing)} (rows of `rollwire distill generate` with distill.top_k)"
            )
        prompt, completion = list(row["prompt_ids"]), list(row["completion_ids"])
        top_ids = np.asarray(row["top_ids"], np.int64)
        top_logprobs = np.asarray(row["top_logprobs"], np.float32)
        if top_ids.ndim != 2 or top_ids.shape != top_logprobs.shape:
            raise ValueError(f"{where}: top_ids and top_logprobs must be two equal [n, k] lists")
        if top_ids.shape[0] != len(completion) or not prompt:
            raise ValueError(
                f"{where}: {top_ids.shape[0]} top-k rows for {len(completion)} completion "
                f"tokens, after {len(prompt)} prompt tokens (both needed)"
            )
        if width is not None and top_ids.shape[1] != width:
            raise ValueError(f"{where}: top-k of {top_ids.shape[1]}, earlier rows {width}")
        width = top_ids.shape[1]
        ids = prompt + completion
        images = _row_images(row, vision, folder, where)
        if images:
            try:
                images = tuple(vision.placed(ids, list(images)))
            except ImageError as error:
                raise ValueError(f"{where}: {error}") from None
        cut = len(ids) > max_length
        if cut and (not truncate or images):
            counts.too_long += 1
            continue
        n = min(len(ids), max_length)
        full_ids = np.zeros((len(ids), width), np.int64)
        full_logprobs = np.zeros((len(ids), width), np.float32)
        full_ids[len(prompt) :], full_logprobs[len(prompt) :] = top_ids, top_logprobs
        mask = [0] * len(prompt) + [1] * len(completion)
        if not any(mask[:n]):
            counts.nothing_to_train += 1
            continue
        examples.append(Distilled(ids[:n], mask[:n], full_ids[:n], full_logprobs[:n], images))
        counts.kept += 1
        counts.truncated += int(cut)
    return examples, counts


def held_out_split(items: Sequence[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held out): a seeded shuffle, then the last `fraction` (at least one item
    when fraction > 0 and there are two or more) held out."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction {fraction} must be in [0, 1)")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    count = round(fraction * len(items))
    if fraction > 0 and len(items) > 1:
        count = max(count, 1)
    cut = len(order) - count
    return [items[i] for i in order[:cut]], [items[i] for i in order[cut:]]
