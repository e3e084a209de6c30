import asyncio

import pytest
import torch

from engine.kv_storage import KVLayout, KVStorage
from kv_transfer.errors import LayoutMismatch, TransferCancelled, TransferTimeout
from kv_transfer.interface import TransferSpec, TransferState
from kv_transfer.local import LocalReceiver, LocalSender

LAYOUT = KVLayout(dtype="bfloat16", num_layers=3, num_blocks=16, block_size=4,
                  num_kv_heads=2, head_dim=8)


def pools():
    src, dst = KVStorage(LAYOUT), KVStorage(LAYOUT)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(1)))
    return src, dst


def spec(rid, src, dst):
    return TransferSpec(request_id=rid, src_block_ids=src, dst_block_ids=dst,
                        layer_begin=0, layer_end=LAYOUT.num_layers)


def test_layers_sent_as_they_finish_land_bitwise_and_keep_blocks():
    async def main():
        src, dst = pools()
        receiver = LocalReceiver(dst)
        sender = LocalSender(src, {receiver.address: receiver})
        released = []
        handle = receiver.expect("a", [9, 2, 3], range(3), released.append, 5.0)
        send = await sender.start(receiver.address, spec("a", [1, 7, 8], [9, 2, 3]), 5.0)
        for layer in (2, 0, 1):
            assert handle.state is TransferState.IN_FLIGHT
            send.send_layer(layer)
            receiver.check_invariants()
        await send.finish()
        await handle.wait()
        for s, d in zip([1, 7, 8], [9, 2, 3]):
            assert torch.equal(src.kv[:, :, s].view(torch.int16), dst.kv[:, :, d].view(torch.int16))
        assert released == [] and receiver.num_expected == 0
    asyncio.run(main())


def test_deadline_releases_once_and_both_sides_raise():
    async def main():
        src, dst = pools()
        receiver = LocalReceiver(dst)
        sender = LocalSender(src, {receiver.address: receiver})
        released = []
        handle = receiver.expect("a", [0, 1], range(3), released.append, 0.05)
        send = await sender.start(receiver.address, spec("a", [4, 5], [0, 1]), 5.0)
        send.send_layer(0)
        with pytest.raises(TransferTimeout):
            await handle.wait()
        send.send_layer(1)  # after the failure: nothing is copied
        send.send_layer(2)
        with pytest.raises(TransferTimeout):
            await send.finish()
        assert released == [[0, 1]]
        assert torch.count_nonzero(dst.kv[1:]) == 0
    asyncio.run(main())


def test_cancel_from_either_side_raises_cancelled_and_releases_once():
    async def main():
        src, dst = pools()
        receiver = LocalReceiver(dst)
        sender = LocalSender(src, {receiver.address: receiver})
        released = []
        h1 = receiver.expect("a", [0], range(3), released.append, 5.0)
        h2 = receiver.expect("b", [1], range(3), released.append, 5.0)
        s1 = await sender.start(receiver.address, spec("a", [4], [0]), 5.0)
        s2 = await sender.start(receiver.address, spec("b", [5], [1]), 5.0)
        await s1.cancel("prefill aborted")
        await h2.cancel("client went away")
        await h2.cancel("twice")
        for waiter in (h1.wait(), s1.finish(), h2.wait(), s2.finish()):
            with pytest.raises(TransferCancelled):
                await waiter
        assert sorted(released) == [[0], [1]]
    asyncio.run(main())


def test_layout_mismatch_is_refused_before_any_copy():
    async def main():
        src, _ = pools()
        other = KVStorage(KVLayout(dtype="bfloat16", num_layers=3, num_blocks=16,
                                   block_size=8, num_kv_heads=2, head_dim=8))
        receiver = LocalReceiver(other)
        receiver.expect("a", [0], range(3), lambda ids: None, 5.0)
        sender = LocalSender(src, {receiver.address: receiver})
        with pytest.raises(LayoutMismatch, match="block_size"):
            await sender.start(receiver.address, spec("a", [4], [0]), 5.0)
        assert torch.count_nonzero(other.kv) == 0
        await receiver.close()
    asyncio.run(main())
