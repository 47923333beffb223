"""Image domains through the reward-server: the digits judge pays for the digit asked
for, measurable properties pay as they say, and bad images are that item's error."""

from __future__ import annotations

import numpy as np
import pytest

from rollwire.diffusion.data import digits
from rollwire.proto.v1 import reward_pb2, reward_pb2_grpc
from rollwire.reward.server import registrations
from rollwire.services.core.client import open_channel
from rollwire.services.core.config import RewardServerConfig
from rollwire.services.core.wire import array_bytes

pytestmark = pytest.mark.integration


def packed(image, dtype: str = "<f4") -> bytes:
    return array_bytes(np.asarray(image), dtype)


def item(item_id: str, domain: str, image: bytes, reference: str = "", **metadata):
    scored = reward_pb2.ScoreItem(item_id=item_id, domain=domain, image=image, reference=reference)
    if metadata:
        scored.metadata.update(metadata)
    return scored


async def test_image_domains_score_and_refuse_bad_images_per_item(start_service) -> None:
    (registration,) = registrations(RewardServerConfig(workers=1))
    runtime = await start_service([registration])
    held, labels = digits("held_out")
    three, seven = held[labels == 3][0], held[labels == 7][0]
    grey = np.full((3, 4, 4), 0.5, np.float32)
    items = [
        item("three-as-3", "digit", packed(three), "3"),
        item("seven-as-3", "digit", packed(three * 0 + seven), "3"),
        item("three-paid-if-correct", "digit", packed(three), "3", pay="correct"),
        item("seven-paid-if-correct", "digit", packed(seven), "3", pay="correct"),
        item("black", "brightness", packed(np.full((1, 8, 8), -1.0))),
        item("white", "brightness", packed(np.ones((1, 8, 8)))),
        item("flat", "contrast", packed(np.zeros((1, 8, 8)))),
        item("on-target", "colour", packed(grey), target=[0.5, 0.5, 0.5]),
        item("far", "colour", packed(grey), target=[-1.0, -1.0, -1.0]),
        # What is wrong with an image is its item's error, with the reason.
        item("none", "digit", b"", "3"),
        item("garbage", "digit", b"\xc1\x00", "3"),
        item("nan", "brightness", packed(np.full((1, 8, 8), np.nan))),
        item("out-of-range", "brightness", packed(np.full((1, 8, 8), 3.0))),
        item("flat-array", "contrast", packed(np.zeros(64))),
        item("ints", "contrast", packed(np.zeros((1, 8, 8)), "<i4")),
        item("no-reference", "digit", packed(three), "x"),
        item("big-digit", "digit", packed(np.zeros((3, 8, 8))), "3"),
        item("no-target", "colour", packed(grey)),
        item("bad-pay", "digit", packed(three), "3", pay="most"),
    ]
    async with open_channel(runtime.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        reply = await stub.Score(reward_pb2.ScoreRequest(items=items))
        listing = await stub.ListScorers(reward_pb2.ListScorersRequest())
    await registration.servicer.close()
    got = {r.item_id: r for r in reply.results}
    assert got["three-as-3"].reward > 0.9 and got["three-as-3"].components["correct"] == 1.0
    assert got["seven-as-3"].reward < 0.1 and got["seven-as-3"].components["correct"] == 0.0
    assert got["three-paid-if-correct"].reward == 1.0
    assert got["seven-paid-if-correct"].reward == 0.0
    assert (got["black"].reward, got["white"].reward) == (0.0, 1.0)
    assert got["flat"].reward == 0.0
    assert got["on-target"].reward == pytest.approx(1.0)
    assert got["far"].reward == pytest.approx(1 - 1.5 * 3**0.5 / (2 * 3**0.5))
    reasons = {
        "none": "the item has none",
        "garbage": "not valid msgpack",
        "nan": "not finite",
        "out-of-range": "not [-1, 1]",
        "flat-array": "[C, H, W]",
        "ints": "float32 or float64",
        "no-reference": "reference digit",
        "big-digit": "1x8x8",
        "no-target": "metadata.target",
        "bad-pay": "pays `probability` or `correct`",
    }
    for item_id, reason in reasons.items():
        assert got[item_id].error and reason in got[item_id].error_message, got[item_id]
        assert got[item_id].reward == 0.0
    assert {"digit", "brightness", "contrast", "colour"} <= {s.domain for s in listing.scorers}
