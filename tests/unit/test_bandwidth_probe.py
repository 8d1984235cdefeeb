"""The bandwidth probe reads past the caches: its size follows the most bytes a level of cache holds on the machine,
every instance counted once, and the memory available."""
from __future__ import annotations

from tfq.bench import measure


def cache(root, cpu: int, index: int, level: int, shared: str, size: str) -> None:
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, text in (("level", str(level)), ("shared_cpu_list", shared), ("size", size)):
        (folder / name).write_text(text + "\n")


def test_each_level_counts_each_instance_once_and_the_largest_level_wins(tmp_path):
    for cpu in range(4):  # two chips' L3 slices of 32 MiB (cpus 0-1, 2-3), a 1 MiB L2 a core, a 48K L1
        cache(tmp_path, cpu, 0, 1, str(cpu), "48K")
        cache(tmp_path, cpu, 2, 2, str(cpu), "1024K")
        cache(tmp_path, cpu, 3, 3, "0-1" if cpu < 2 else "2-3", "32M")
    assert measure.largest_cache_bytes(str(tmp_path)) == 64 * 2**20
    cache(tmp_path, 4, 3, 3, "4", "junk")
    assert measure.largest_cache_bytes(str(tmp_path)) == 64 * 2**20
    assert measure.largest_cache_bytes(str(tmp_path / "none")) == 0


def test_the_probe_is_four_times_the_cache_within_its_floor_and_a_quarter_of_the_memory(monkeypatch):
    for cache_bytes, available, want in ((300 * 2**20, 64 << 10, 1280), (32 * 2**20, 64 << 10, measure.BANDWIDTH_MIB),
                                         (0, 64 << 10, measure.BANDWIDTH_MIB), (65 * 2**20, 64 << 10, 512),
                                         (300 * 2**20, 2048, 512), (300 * 2**20, 100, measure.BANDWIDTH_MIB)):
        monkeypatch.setattr(measure, "largest_cache_bytes", lambda: cache_bytes)
        monkeypatch.setattr(measure, "_available_mib", lambda: available)
        assert measure.probe_mib() == want, (cache_bytes, available)
