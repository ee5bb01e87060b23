"""ZeRO chunk packing and the chunk-size search (no process group)."""

from __future__ import annotations

import pytest

from autopar.planner.chunks import MIN_CHUNKS, ChunkPricing, planned_chunk_bytes
from autopar.runtime.zero import choose_chunk_bytes, chunk_numels, pack_chunks


def test_packing_keeps_order_and_never_splits_a_parameter() -> None:
    numels = [4, 4, 6, 2, 10, 1]
    chunks = pack_chunks(numels, 8)
    assert chunks == [[0, 1], [2, 3], [4], [5]]
    assert [i for c in chunks for i in c] == list(range(len(numels)))
    # A parameter larger than the chunk gets a chunk of its own size.
    assert chunk_numels(numels, chunks, 8, 1) == [8, 8, 10, 1]


def test_chunk_sizes_are_padded_to_the_shard_count() -> None:
    numels = [3, 3, 5]
    chunks = pack_chunks(numels, 6)
    assert chunks == [[0, 1], [2]]
    assert chunk_numels(numels, chunks, 6, 4) == [8, 8]  # 6 -> 8, last trimmed 5 -> 8


def test_search_finds_a_zero_waste_size_when_one_exists() -> None:
    # Layers of 96 + 32 elements pack exactly into chunks of 128.
    numels = [96, 32] * 8
    chunk_bytes, waste = choose_chunk_bytes(numels, 2, itemsize=4, max_chunk_bytes=160 * 4)
    assert chunk_bytes % (2 * 4) == 0
    assert waste == 0.0


def test_search_minimises_waste_over_candidates() -> None:
    numels = [100, 60, 100, 60, 100, 60, 7]
    chunk_bytes, waste = choose_chunk_bytes(numels, 4, itemsize=4, max_chunk_bytes=400 * 4)
    size = chunk_bytes // 4
    assert size % 4 == 0 and size >= 100
    brute = min(
        sum(chunk_numels(numels, pack_chunks(numels, c), c, 4)) - sum(numels)
        for c in range(100, 401, 4)
    )
    got = sum(chunk_numels(numels, pack_chunks(numels, size), size, 4)) - sum(numels)
    assert got == brute
    assert waste == pytest.approx(got / (got + sum(numels)))


def test_search_edge_cases() -> None:
    assert choose_chunk_bytes([], 2)[1] == 0.0
    with pytest.raises(ValueError, match="zero_shards"):
        choose_chunk_bytes([4], 0)
    chunk_bytes, _ = choose_chunk_bytes([10**6], 8)
    assert chunk_bytes >= 10**6 * 4  # the largest parameter sets the lower end


# -- the priced search (planner.chunks.ChunkPricing) --------------------------------------------

# The tiny GPT of benchmarks/like_for_like.py: 28 parameters, 7.4 MB.
GPT_NUMELS = (
    [262144, 16384]
    + [
        n
        for _ in range(2)
        for n in (256, 256, 196608, 768, 65536, 256, 256, 256, 262144, 1024, 262144, 256)
    ]
    + [256, 256]
)


def _pricing(link: str, device: str, stage: int, ranks: int, compute_s: float) -> ChunkPricing:
    from cost_models import get_device, get_link

    return ChunkPricing.on_mesh(
        shape=(ranks,),
        links=[get_link(link)],
        device=get_device(device),
        stages=(stage,),
        forward_s=compute_s / 3,
        backward_s=2 * compute_s / 3,
    )


def _num_chunks(chunk_bytes: int, numels: list[int]) -> int:
    return len(pack_chunks(numels, chunk_bytes // 4))


def test_exposed_seconds_by_hand() -> None:
    # Stage 1 on 2 ranks of a link with latency 1 and bandwidth 1 B/s (one step each way).
    from cost_models import LinkSpec

    link = LinkSpec(name="unit", bandwidth_Bps=1.0, latency_s=1.0)
    pricing = ChunkPricing(axes=((2, link, 1),), forward_s=10.0, backward_s=20.0)
    # all_reduce of B bytes: 2 steps + B wire; refresh (all-gather): 1 step + B/2 wire.
    assert pricing.reduce_s(4.0) == 2 + 4 and pricing.refresh_s(4.0) == 1 + 2
    # Two chunks of 4 bytes: the second (first in backward) is reduced while the first's
    # backward runs (10 s > 6 s), the first's reduction ends 6 s after backward: exposed 6 s,
    # plus both refreshes (after the step, hidden by nothing).
    assert pricing.step_s([4.0, 4.0]) == pytest.approx(6 + 2 * 3)
    # One chunk of 8 bytes: reduced after backward, 10 s; refresh 5 s.
    assert pricing.step_s([8.0]) == pytest.approx(10 + 5)
    # With no compute to hide behind, every collective is exposed.
    bare = ChunkPricing(axes=((2, link, 1),), forward_s=0.0, backward_s=0.0)
    assert bare.step_s([4.0, 4.0]) == pytest.approx(2 * (6 + 3))
    # gloo refreshes with one broadcast per rank: 2 x (1 step + 2 bytes); on CPU cores its
    # collectives overlap nothing.
    gloo = ChunkPricing(
        axes=((2, link, 1),), forward_s=10, backward_s=20, broadcast_refresh=True, overlap=False
    )
    assert gloo.refresh_s(4.0) == 2 * (1 + 2)
    assert gloo.step_s([4.0, 4.0]) == pytest.approx(2 * (6 + 6))


@pytest.mark.parametrize("ranks", [2, 4])
def test_gloo_latency_gives_few_chunks_where_padding_alone_gave_many(ranks: int) -> None:
    # The like-for-like GPT on gloo (50 us a step): the runtime's default search (padding,
    # capped at 1/8 of the model) makes 12 chunks: 12 all-reduces and 12 x ranks broadcasts.
    default, _ = choose_chunk_bytes(GPT_NUMELS, ranks, min_chunks=MIN_CHUNKS)
    assert _num_chunks(default, GPT_NUMELS) == 12
    pricing = _pricing("loopback", "cpu", 1, ranks, compute_s=0.04)
    priced, _ = planned_chunk_bytes(GPT_NUMELS, pricing, max_stage=1, headroom_bytes=2**30)
    assert _num_chunks(priced, GPT_NUMELS) == 1  # gloo on CPU: nothing overlaps
    sizes = lambda b: [4 * sum(GPT_NUMELS[i] for i in c) for c in pack_chunks(GPT_NUMELS, b // 4)]  # noqa: E731
    assert pricing.step_s(sizes(priced)) < pricing.step_s(sizes(default))


def test_fast_links_with_compute_to_hide_behind_take_several_chunks() -> None:
    # 100 layers of 4 MiB on 8 ranks of an InfiniBand axis: one chunk would expose the whole
    # reduction; many chunks hide all but the last behind backward.
    numels = [2**20] * 100
    pricing = _pricing("infiniband", "h100", 2, 8, compute_s=0.3)
    chunk_bytes, _ = planned_chunk_bytes(numels, pricing, max_stage=2, headroom_bytes=2**40)
    assert 4 <= _num_chunks(chunk_bytes, numels) < 100


def test_budget_headroom_caps_the_chunk() -> None:
    numels = [2**20] * 100
    pricing = _pricing("loopback", "cpu", 3, 4, compute_s=0.0)
    headroom = 5 * 8 * 2**22  # stage 3: five chunk transients of 8 layers each
    chunk_bytes, _ = planned_chunk_bytes(numels, pricing, max_stage=3, headroom_bytes=headroom)
    assert 4 * 2**20 <= chunk_bytes <= 8 * 2**22
    # No headroom: never below the largest parameter.
    assert planned_chunk_bytes(numels, pricing, max_stage=3, headroom_bytes=0)[0] == 2**22


def test_overlap_and_refresh_are_the_devices_not_its_names() -> None:
    # The CPU preset runs gloo (broadcast refresh, nothing overlaps); GPU presets NCCL. A device
    # whose name says "cpu" but whose spec says NCCL is priced as NCCL, and the reverse.
    from dataclasses import replace

    from cost_models import DeviceSpec, get_device, get_link, load_profile

    cpu, h100 = get_device("cpu"), get_device("h100")
    assert (cpu.comm_backend, cpu.collectives_overlap_compute) == ("gloo", False)
    assert (h100.comm_backend, h100.collectives_overlap_compute) == ("nccl", True)
    link = get_link("loopback")
    for device, gloo in (
        (cpu, True),
        (h100, False),
        (
            replace(cpu, name="cpu-box", comm_backend="nccl", collectives_overlap_compute=True),
            False,
        ),
        (
            replace(h100, name="gpu-box", comm_backend="gloo", collectives_overlap_compute=False),
            True,
        ),
    ):
        pricing = ChunkPricing.on_mesh(
            shape=(4,), links=[link], device=device, stages=(1,), forward_s=1.0, backward_s=2.0
        )
        assert (pricing.broadcast_refresh, pricing.overlap) == (gloo, not gloo), device.name
        assert DeviceSpec.from_dict(device.to_dict()) == device
    # GPU defaults are not written, so preset plans keep their JSON; the CPU preset's are.
    assert "comm_backend" not in h100.to_dict() and cpu.to_dict()["comm_backend"] == "gloo"
    with pytest.raises(ValueError, match="comm_backend must be one of"):
        replace(h100, comm_backend="tcp")
    # A calibration from before these fields: its meta names the backend.
    old = {"version": 1, "device": {"base": "h100", "name": "calibrated-cpu"}, "meta": {}}
    old["meta"]["backend"] = "gloo"
    device = load_profile(old).device
    assert device is not None and not device.collectives_overlap_compute
    assert device.comm_backend == "gloo"
