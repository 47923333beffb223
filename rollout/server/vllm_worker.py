"""A vLLM worker extension that takes rollwire's weights over vLLM's HTTP `collective_rpc`.

Start a vLLM server you run yourself with

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls \\
        rollwire.rollout.server.vllm_worker.WeightLoader --logprobs-mode processed_logprobs

and point a rollout-server at it (`engine: openai`, `engine_args: {update_weights: vllm}`):
each update then arrives as one safetensors blob (base64 in the JSON body) and is loaded
in place on every worker, as the in-process vLLM engine loads it.
"""

from __future__ import annotations

import base64


class WeightLoader:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def rollwire_load_weights(self, payload: str) -> int:
        """Loads checkpoint-named tensors from base64 safetensors bytes; returns how many."""
        from safetensors.torch import load

        from rollwire.rollout.server.vllm_engine import load_checkpoint_weights

        return load_checkpoint_weights(self, load(base64.b64decode(payload)))
