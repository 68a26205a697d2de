"""Block layout: every block aligned to the cache line, and skewed starts spread over the sets."""

import pytest

from kunlun_runtime.kv.block_layout import build_block_layout

LINE, SETS = 64, 64


@pytest.mark.parametrize("block_bytes", [16 * 3 * 64 * 2, 16 * 8 * 128 * 2, 4096, 100, 65])
def test_every_block_is_cache_line_aligned_and_stride_covers_payload(block_bytes):
    layout = build_block_layout(block_bytes, cache_line_bytes=LINE, cache_num_sets=SETS, skew=True)
    assert layout.stride_bytes >= block_bytes
    assert layout.stride_bytes % LINE == 0
    assert all(layout.offset_bytes(i) % LINE == 0 for i in range(500))


def test_aligned_only_layout_maps_power_of_two_blocks_onto_one_set():
    # 16 tokens × 8 heads × 128 dims × 2 bytes = 32 KiB = 512 lines: a multiple of the 64-set period.
    layout = build_block_layout(32768, cache_line_bytes=LINE, cache_num_sets=SETS, skew=False)
    assert {layout.set_index(i) for i in range(256)} == {0}


def test_skewed_layout_gives_consecutive_blocks_distinct_sets():
    layout = build_block_layout(32768, cache_line_bytes=LINE, cache_num_sets=SETS, skew=True)
    assert layout.stride_bytes == 32768 + LINE
    assert sorted(layout.set_index(i) for i in range(SETS)) == list(range(SETS))


def test_skew_adds_nothing_when_the_stride_is_already_odd_in_lines():
    layout = build_block_layout(3 * LINE, cache_line_bytes=LINE, cache_num_sets=SETS, skew=True)
    assert layout.padding_bytes == 0


@pytest.mark.parametrize(("line", "sets"), [(48, 64), (64, 100), (0, 64)])
def test_rejects_non_power_of_two_geometry(line, sets):
    with pytest.raises(ValueError, match="power of two"):
        build_block_layout(1024, cache_line_bytes=line, cache_num_sets=sets, skew=True)
