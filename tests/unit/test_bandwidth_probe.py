"""The bandwidth probe reads past the caches: its size follows the largest cache the machine reports."""
from __future__ import annotations

from tfq.bench import measure


def test_the_largest_cache_is_read_from_sysfs_sizes(tmp_path):
    for index, size in enumerate(("48K", "2048K", "300M", "junk")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert measure.largest_cache_bytes(str(tmp_path)) == 300 * 2**20
    assert measure.largest_cache_bytes(str(tmp_path / "none")) == 0


def test_the_probe_is_four_times_the_largest_cache_and_never_under_its_floor(monkeypatch):
    for cache, want in ((300 * 2**20, 1280), (32 * 2**20, measure.BANDWIDTH_MIB), (0, measure.BANDWIDTH_MIB),
                        (65 * 2**20, 512)):
        monkeypatch.setattr(measure, "largest_cache_bytes", lambda: cache)
        assert measure.probe_mib() == want, cache
