"""Weight updates sent whole against sent as deltas (`trainer.weights.deltas`), on
SmolLM2-135M's shape, against raw TCP of the same bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_deltas.py [--updates 4] [--lr 5e-6]

The model is SmolLM2-135M's configuration, randomly initialised (the converted model
at --model when it exists). Each update is one AdamW step (the SmolLM2 example's
learning rate) on random gradients: Adam moves every weight by about the learning
rate whatever the gradient's size, so the bytes that change are those of a real
step. Each version goes to two `rollwire rollout-server` processes (HF engine): one
by whole streams, one by deltas (`publish(..., deltas=...)`), each timed from the
first chunk to the server's acknowledgement once the weights are applied. On the
wire: float32 (the trainer's weights as they are) and bfloat16 (what a bf16 engine
serves); and a LoRA run's merged weights (only the adapted projections q, k, v, o
change: their every element, the other tensors not at all). The baseline sends the
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_speed import model_folder
from weight_sync import Servers, time_raw

from rollwire.proto.v1 import rollout_pb2_grpc
from rollwire.services.core.client import open_channel, wait_for_serving
from rollwire.trainer.process.weight_sender import Deltas, publish

MiB = 1 << 20


class Trainer:
    """The weights and an AdamW on them; `named_weights` in the wire dtype."""

    def __init__(self, folder: Path, lr: float, wire: torch.dtype, lora: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        targets = ("q_proj", "k_proj", "v_proj", "o_proj")
        self.parameters = [
            p
            for name, p in self.model.named_parameters()
            if not lora or any(f"{target}.weight" in name for target in targets)
        ]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.wire = wire

    def step(self) -> None:
        for parameter in self.parameters:
            parameter.grad = torch.randn(parameter.shape, generator=self.generator)
        self.optimizer.step()

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(self.wire)) for n, p in self.model.named_parameters()]


async def run(addresses: list[str], trainer: Trainer, updates: int, first: int) -> dict:
    channels = [open_channel(address) for address in addresses]
    try:
        for address, channel in zip(addresses, channels, strict=True):
            await wait_for_serving(channel, timeout=120, target=address)
        whole_stub, delta_stub = (rollout_pb2_grpc.RolloutServiceStub(c) for c in channels)
        deltas = Deltas()
        rows = []
        for index in range(updates):
            trainer.step()
            version = first + index
            named = trainer.named_weights()
            whole_s = await publish([whole_stub], trainer, version, 4 * MiB, 600, named=named)
            delta_s = await publish(
                [delta_stub], trainer, version, 4 * MiB, 600, named=named, deltas=deltas
            )
            rows.append((whole_s, delta_s, deltas.bytes_whole, deltas.bytes_sent))
        return {"rows": rows[1:]}  # the first goes whole either way
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
            trainer = Trainer(folder, args.lr, wire, lora)
            servers = Servers(2, folder, work)
            try:
                result = asyncio.run(run(servers.addresses, trainer, args.updates + 1, version))
            finally:
                servers.stop()
            version += args.updates + 1
            rows = result["rows"]
            whole_bytes = statistics.median(r[2] for r in rows)
            delta_bytes = statistics.median(r[3] for r in rows)
            raw_whole = statistics.median(time_raw(bytes(int(whole_bytes)), 1) for _ in range(3))
            raw_delta = statistics.median(time_raw(bytes(int(delta_bytes)), 1) for _ in range(3))
            name = str(wire).removeprefix("torch.") + (" LoRA" if lora else "")
            for mode, seconds, sent, raw in (
                ("whole", statistics.median(r[0] for r in rows), whole_bytes, raw_whole),
                ("delta", statistics.median(r[1] for r in rows), delta_bytes, raw_delta),
            ):
                table.append((name, mode, sent / 1e6, sent / whole_bytes, seconds, raw))
        header = (
            f"{'wire':>13} {'mode':>6} {'MB sent':>8} {'x whole':>8} {'update s':>9} "
            f"{'raw s':>7} {'x raw':>6} {'x whole s':>9}"
        )
        print(f"SmolLM2-135M's shape, AdamW lr {args.lr:g}, {args.updates} updates a row\n")
        print(header)
        print("-" * len(header))
        whole_seconds = {}
        for name, mode, mb, share, seconds, raw in table:
            whole_seconds.setdefault(name, seconds)
            print(
                f"{name:>13} {mode:>6} {mb:>8.1f} {share:>8.3f} {seconds:>9.3f} {raw:>7.3f} "
                f"{seconds / raw:>6.1f} {seconds / whole_seconds[name]:>9.2f}"
            )
        print(
            "\nupdate s: median, first chunk to the server's answer (weights applied; a "
            "delta's encoding, checksums and the base's copy included); raw s: the same "
            "bytes over one TCP socket; x whole s: against the whole update of the same wire."
        )


if __name__ == "__main__":
    main()
