"""Weight updates sent whole against sent as deltas (`trainer.weights.deltas`) and, for a
LoRA run, as adapters alone (`trainer.weights.adapters`), on SmolLM2-135M's shape,
against raw TCP of the same bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_deltas.py [--updates 4] [--lr 5e-6]

The model is SmolLM2-135M's configuration, randomly initialised (the converted model
at --model when it exists). Each update is one AdamW step (the SmolLM2 example's
learning rate) on random gradients: Adam moves every weight by about the learning
rate whatever the gradient's size, so the bytes that change are those of a real
step. Each version goes to two `rollwire rollout-server` processes (HF engine): one
by whole streams, one by deltas (`publish(..., deltas=...)`), each timed from the
first chunk to the server's acknowledgement once the weights are applied. On the
wire: float32 (the trainer's weights as they are) and bfloat16 (what a bf16 engine
serves); and a LoRA run (peft, rank 16 on q, k, v, o; only the adapters step), whose
merged weights go whole, by delta, and as adapters alone to a third server. The
baseline sends the
same bytes the plainest way (one TCP socket,
`sendall`), in the same run; the first update of each goes whole either way and is
left out of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_speed import model_folder
from weight_sync import Servers, time_raw

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.rollout.server.weights import merge_adapter
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.trainer.process.weight_sender import Adapters, Deltas, publish

MiB = 1 << 20


class LoraTrainer:
    """A LoRA run's side: peft adapters (rank 16, alpha 32) on q, k, v, o and an AdamW on
    them; its merged weights and adapters as the learner publishes them."""

    def __init__(self, folder: Path, lr: float) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config = LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
        self.model = get_peft_model(base, config)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> None:
        for parameter in self.parameters:
            parameter.grad = torch.randn(parameter.shape, generator=self.generator)
        self.optimizer.step()

    def _layers(self) -> dict:
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}

    def named_adapters(self) -> list:
        return [
            (
                f"{name}.weight",
                layer.get_base_layer().weight.detach(),
                layer.lora_A["default"].weight.detach(),
                layer.lora_B["default"].weight.detach(),
                float(layer.scaling["default"]),
            )
            for name, layer in self._layers().items()
        ]

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        merged = {
            name: merge_adapter(base, a, b, scale)
            for name, base, a, b, scale in self.named_adapters()
        }
        out = []
        for name, p in self.model.get_base_model().named_parameters():
            if "lora_" in name:
                continue
            name = name.replace(".base_layer.", ".")
            out.append((name, merged.get(name, p.detach())))
        return out


class Trainer:
    """The weights and an AdamW on them; `named_weights` in the wire dtype."""

    def __init__(self, folder: Path, lr: float, wire: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.parameters = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.wire = wire

    def step(self) -> None:
        for parameter in self.parameters:
            parameter.grad = torch.randn(parameter.shape, generator=self.generator)
        self.optimizer.step()

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(self.wire)) for n, p in self.model.named_parameters()]


async def run(addresses: list[str], trainer: Any, updates: int, first: int) -> list[dict]:
    """Per update: {mode: (seconds, bytes sent)} for whole, delta (and adapters with a
    third server)."""
    channels = [open_channel(address) for address in addresses]
    try:
        for address, channel in zip(addresses, channels, strict=True):
            await wait_for_serving(channel, timeout=120, target=address)
        stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in channels]
        deltas, adapters = Deltas(), Adapters()
        rows = []
        for index in range(updates):
            trainer.step()
            version = first + index
            named = trainer.named_weights()
            whole_bytes = sum(t.numel() * t.element_size() for _, t in named)
            row = {
                "whole": (
                    await publish([stubs[0]], trainer, version, 4 * MiB, 600, named=named),
                    whole_bytes,
                ),
                "delta": (
                    await publish(
                        [stubs[1]], trainer, version, 4 * MiB, 600, named=named, deltas=deltas
                    ),
                    deltas.bytes_sent,
                ),
            }
            if len(stubs) > 2:
                seconds = await publish(
                    [stubs[2]], trainer, version, 4 * MiB, 600, named=named, adapters=adapters
                )
                row["adapters"] = (seconds, adapters.bytes_sent)
            rows.append(row)
        return rows[1:]  # the first goes whole either way (with the bases, for adapters)
    finally:
        for channel in channels:
            await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--updates", type=int, default=4, help="versions per row (4)")
    parser.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate (5e-6)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        folder = model_folder(args.model, work)
        table = []
        version = 1
        for wire, lora in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
            trainer = LoraTrainer(folder, args.lr) if lora else Trainer(folder, args.lr, wire)
            servers = Servers(3 if lora else 2, folder, work)
            try:
                rows = asyncio.run(run(servers.addresses, trainer, args.updates + 1, version))
            finally:
                servers.stop()
            version += args.updates + 1
            name = str(wire).removeprefix("torch.") + (" LoRA" if lora else "")
            whole_bytes = statistics.median(r["whole"][1] for r in rows)
            for mode in rows[0]:
                sent = statistics.median(r[mode][1] for r in rows)
                seconds = statistics.median(r[mode][0] for r in rows)
                raw = statistics.median(time_raw(bytes(int(sent)), 1) for _ in range(3))
                table.append((name, mode, sent / 1e6, sent / whole_bytes, seconds, raw))
        header = (
            f"{'wire':>13} {'mode':>8} {'MB sent':>8} {'x whole':>8} {'update s':>9} "
            f"{'raw s':>7} {'x raw':>6} {'x whole s':>9}"
        )
        print(f"SmolLM2-135M's shape, AdamW lr {args.lr:g}, {args.updates} updates a row\n")
        print(header)
        print("-" * len(header))
        whole_seconds = {}
        for name, mode, mb, share, seconds, raw in table:
            whole_seconds.setdefault(name, seconds)
            print(
                f"{name:>13} {mode:>8} {mb:>8.2f} {share:>8.3f} {seconds:>9.3f} {raw:>7.3f} "
                f"{seconds / raw:>6.1f} {seconds / whole_seconds[name]:>9.2f}"
            )
        print(
            "\nupdate s: median, first chunk to the server's answer (weights applied; a "
            "delta's encoding, checksums and the base's copy included); raw s: the same "
            "bytes over one TCP socket; x whole s: against the whole update of the same wire."
        )


if __name__ == "__main__":
    main()
