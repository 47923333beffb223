"""LoRA on the local backend (`trainer.lora`): only the adapters train, the published
weights are the merged ones, and a checkpoint round-trips the adapters and optimizer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rollwire.services.core.config import LoraConfig, RLSection, TrainerConfig
from rollwire.trainer.batching import collate
from rollwire.trainer.rl.policy import Policy
from tests.helpers.trajectories import group

LORA = LoraConfig(rank=4, alpha=8.0)


def make_policy(path, **settings) -> Policy:
    settings.setdefault("lora", LORA)
    return Policy(path, TrainerConfig(**settings), RLSection(group_size=4, max_steps=4))


def adapters(policy: Policy) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Target layer name (plain model's) -> its (B, A) weights."""
    from peft.tuners.lora import LoraLayer

    base = policy.learner.model.get_base_model()
    return {
        name: (layer.lora_B["default"].weight.detach(), layer.lora_A["default"].weight.detach())
        for name, layer in base.named_modules()
        if isinstance(layer, LoraLayer)
    }


def test_config_defaults_and_unknown_keys() -> None:
    assert TrainerConfig().lora is None
    lora = TrainerConfig(lora={}).lora
    assert lora == LoraConfig()
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValidationError, match="extra"):
        TrainerConfig(lora={"rank": 4, "lora_alpha": 8})
    with pytest.raises(ValidationError):
        LoraConfig(rank=0)
    with pytest.raises(ValidationError):
        LoraConfig(dropout=1.0)
    # Adapters alone are a LoRA run's, by stream, instead of deltas.
    assert TrainerConfig(lora={}, weights={"adapters": True}).weights.adapters
    with pytest.raises(ValidationError, match="set trainer.lora too"):
        TrainerConfig(weights={"adapters": True})
    with pytest.raises(ValidationError, match="choose one"):
        TrainerConfig(lora={}, weights={"adapters": True, "deltas": True})
    with pytest.raises(ValidationError, match="needs transport: stream"):
        TrainerConfig(lora={}, weights={"adapters": True, "transport": "group"})


def test_only_the_adapters_train(tiny_model_path) -> None:
    policy = make_policy(tiny_model_path, learning_rate=5e-2)
    trainable = {n for n, p in policy.learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    held = {id(p) for group in policy.learner.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in policy.learner.model.named_parameters() if n in trainable}
    # Every attention projection of both layers has its A and B.
    assert len(trainable) == 2 * 4 * 2
    before = {n: p.detach().clone() for n, p in policy.learner.model.named_parameters()}
    metrics = policy.train_step(group(), 0)
    assert metrics["optimizer_steps"] == 1
    for name, p in policy.learner.model.named_parameters():
        if name in trainable:
            continue
        assert torch.equal(p, before[name]), name
    # B starts at zero; after one update every adapter has moved.
    assert all(
        not torch.equal(p, before[n])
        for n, p in policy.learner.model.named_parameters()
        if ".lora_B." in n
    )


def test_published_weights_are_merged_and_load_into_a_plain_model(tiny_model_path) -> None:
    from transformers import AutoModelForCausalLM

    policy = make_policy(tiny_model_path, learning_rate=5e-2)
    policy.train_step(group(), 0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    base = dict(plain.named_parameters())
    published = dict(policy.named_weights())
    assert published.keys() == base.keys()
    pairs = adapters(policy)
    assert len(pairs) == 8
    scale = LORA.alpha / LORA.rank
    for name, tensor in published.items():
        owner = name.removesuffix(".weight")
        if owner in pairs:
            b, a = pairs[owner]
            assert b.abs().sum() > 0, owner
            torch.testing.assert_close(tensor, base[name] + scale * b @ a, msg=name)
            assert not torch.equal(tensor, base[name]), name
        else:
            assert torch.equal(tensor, base[name]), name
    # The adapters stay apart: the model still computes W x + scale B A x.
    layer = policy.learner.model.get_base_model().model.layers[0].self_attn.q_proj
    assert torch.equal(layer.base_layer.weight, base["model.layers.0.self_attn.q_proj.weight"])
    # The plain model's full state dict: the tied lm_head is the embedding's tensor.
    state = dict(published)
    for key in plain.state_dict().keys() - state.keys():
        assert plain.get_parameter(key) is plain.get_input_embeddings().weight, key
        state[key] = state["model.embed_tokens.weight"]
    plain.load_state_dict(state, strict=True)
    tokens = torch.tensor([[20, 3, 14, 3, 21, 3, 32]])
    with torch.no_grad():
        policy.learner.model.eval()
        torch.testing.assert_close(
            plain(input_ids=tokens).logits, policy.learner.model(input_ids=tokens).logits
        )


def test_the_kl_reference_is_the_base_model_without_a_copy(tiny_model_path) -> None:
    from transformers import AutoModelForCausalLM

    policy = make_policy(tiny_model_path, learning_rate=5e-2, kl={"coef": 0.1})
    policy.train_step(group(), 0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = collate(group(), policy.learner.pad_token_id)
    with torch.no_grad():
        expected = policy.step.updater.logprobs(plain, batch)
        torch.testing.assert_close(
            policy.step.updater.logprobs(policy.step.reference, batch), expected
        )
        assert not torch.allclose(
            policy.step.updater.logprobs(policy.learner.model, batch), expected
        )


def test_checkpoint_round_trip(tiny_model_path, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    straight = make_policy(tiny_model_path, learning_rate=1e-2)
    straight.train_step(group(), 0)
    folder = straight.save_checkpoint(tmp_path / "ckpt", step=1, version=1)
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert (folder / "trainer_state.pt").is_file()
    # The top level is the merged plain model, as a rollout-server loads it.
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    published = dict(straight.named_weights())
    for name, p in merged.named_parameters():
        torch.testing.assert_close(p, published[name], rtol=0, atol=0, msg=name)

    resumed = make_policy(tiny_model_path, learning_rate=1e-2)
    resumed.restore(folder)
    assert resumed.learner.optimizer_steps == 1
    for (name, ours), theirs in zip(
        resumed.learner.model.named_parameters(), straight.learner.model.parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    straight.train_step(group(), 1)
    resumed.train_step(group(), 1)
    for (name, ours), theirs in zip(
        resumed.learner.model.named_parameters(), straight.learner.model.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="LoRA"):
        Policy(tiny_model_path, TrainerConfig(), RLSection(group_size=4, max_steps=4)).restore(
            folder
        )
