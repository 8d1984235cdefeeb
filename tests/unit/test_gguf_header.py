"""Crafted GGUF headers (issue 46, point 7): every count, length, dimension and offset a file states is checked
against the file before anything is built from it. A fuzz over the header of a small valid file: each mutated
file is read as `tfq plan --model` reads it (header, config, tensor index) or refused with a TfqError, within a
second and a bounded amount of memory; and the crafted files the review found exit 2 with one line."""
from __future__ import annotations

import contextlib
import io
import resource
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli import tfq
from tfq.errors import TfqError

ARCH = "qwen35moe"  # a hybrid mixture: the header's every part (DeltaNet sizes, stacked experts) is read
EXPERTS = "blk.0.ffn_gate_exps.weight"


def write_small_gguf(path: Path) -> Path:
    """A header-complete qwen35moe file of zeros (2 layers, 4 experts, 16 tokens) that `tfq plan` reads: no
    transformers model behind it, so it is written in milliseconds."""
    import gguf

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_custom_alignment(32)  # written, so that the fuzz can change it
    w.add_block_count(2)
    w.add_context_length(8192)
    w.add_embedding_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(8)
    w.add_array(f"{ARCH}.rope.dimension_sections", [2, 1, 1, 0])
    for key, value in (("full_attention_interval", 2), ("ssm.conv_kernel", 4), ("ssm.state_size", 16),
                       ("ssm.group_count", 1), ("ssm.time_step_rank", 2), ("ssm.inner_size", 32),
                       ("expert_shared_feed_forward_length", 32)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(16)])
    w.add_token_types([1] * 16)
    w.add_token_merges(["t 0"])
    w.add_eos_token_id(1)

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    w.add_tensor("token_embd.weight", zeros(16, 64))
    w.add_tensor("output_norm.weight", zeros(64))
    for i in range(2):
        tensors = {"attn_norm.weight": zeros(64), "post_attention_norm.weight": zeros(64)}
        if i == 1:
            tensors.update({"attn_q.weight": zeros(128, 64), "attn_k.weight": zeros(32, 64),
                            "attn_v.weight": zeros(32, 64), "attn_output.weight": zeros(64, 64)})
        else:
            tensors.update({"attn_qkv.weight": zeros(64, 64), "attn_gate.weight": zeros(32, 64),
                            "ssm_a": zeros(2), "ssm_out.weight": zeros(64, 32)})
        tensors.update({"ffn_gate_inp.weight": zeros(4, 64), "ffn_down_exps.weight": zeros(4, 64, 32)})
        for name, data in tensors.items():
            w.add_tensor(f"blk.{i}.{name}", data)
        q8 = gguf.GGMLQuantizationType.Q8_0  # quantized blocks too: their sizes in blocks, not elements
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", gguf.quants.quantize(zeros(4, 32, 64), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------- where the header's numbers lie

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_UNSIGNED = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}  # a field is overwritten by its width, whatever it held


def header_fields(data: bytes) -> tuple[dict[str, tuple[int, int]], int]:
    """{what: (offset, width)} of every number in a valid GGUF header (the counts, lengths, value types,
    values, dims, tensor types and offsets a crafted file can lie in), and where the header ends. Read here,
    apart from tfq's parser, so that the fuzz does not trust what it tests."""
    fields: dict[str, tuple[int, int]] = {}
    pos = 8

    def take(fmt: str, what: str):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        if "[2]" not in what:  # an array's first elements stand for the rest (the fuzz then draws fewer strings)
            fields[what] = (pos, struct.calcsize(fmt))
        pos += struct.calcsize(fmt)
        return v

    def string(what: str) -> str:
        nonlocal pos
        n = take("<Q", f"{what} length")
        pos += n
        return data[pos - n:pos].decode()

    def value(vtype: int, what: str) -> None:
        if vtype == 8:
            string(what)
        elif vtype == 9:
            etype, count = take("<I", f"{what} element type"), take("<Q", f"{what} count")
            for i in range(count):
                value(etype, f"{what}[{min(i, 2)}]")
        else:
            take(_SCALARS[vtype], what)

    n_tensors, n_kv = take("<Q", "tensor count"), take("<Q", "key count")
    for _ in range(n_kv):
        key = string("key")
        fields[f"{key} name length"] = fields.pop("key length")
        value(take("<I", f"{key} type"), key)
    for _ in range(n_tensors):
        name = string("tensor name")
        fields[f"{name} name length"] = fields.pop("tensor name length")
        for d in range(take("<I", f"{name} n_dims")):
            take("<Q", f"{name} dim {d}")
        take("<I", f"{name} type")
        take("<Q", f"{name} offset")
    return fields, pos


def with_fields(data: bytes, fields: dict[str, tuple[int, int]], values: dict[str, int]) -> bytes:
    """`data` with the named fields set (as their width's unsigned integer, wrapped to it)."""
    out = bytearray(data)
    for what, v in values.items():
        pos, width = fields[what]
        struct.pack_into(_UNSIGNED[width], out, pos, v % 2 ** (8 * width))
    return bytes(out)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The small file's bytes, its header's fields and the header's end; read once unbounded, so that the
    imports of the first reading do not count against the bound of the ones the tests time."""
    path = write_small_gguf(tmp_path_factory.mktemp("gguf-header") / "small.gguf")
    read_as_plan_does(path)
    data = path.read_bytes()
    return (data, *header_fields(data))


# ------------------------------------------------------------------------------------------ the reading


class TookTooLong(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds: float, extra_bytes: int):
    """Interrupt the block after `seconds` (TookTooLong), and let it map at most `extra_bytes` more memory (a
    MemoryError past that, rather than a machine swapping)."""
    def stop(*_):
        raise TookTooLong(f"still reading after {seconds} s")

    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limits = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, stop)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, limits[1]))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, limits)
        signal.signal(signal.SIGALRM, previous)


def read_as_plan_does(path: Path) -> None:
    """What `tfq plan --model PATH` reads of a GGUF file: its header, its config and its tensor index (the
    weights line counts every matrix)."""
    from rich.console import Console

    from tfq.plan.resolve import resolve_plan

    resolve_plan(None, str(path), (), quiet=False, console=Console(file=io.StringIO()))


def outcome(path: Path, mutation) -> str:
    """'read', or the TfqError's one line; anything else (another exception, a second, a GiB more memory)
    fails, naming the `mutation`."""
    try:
        with bounded(1.0, 2 ** 30):
            read_as_plan_does(path)
        return "read"
    except TfqError as e:
        assert str(e) and "\n" not in str(e), (mutation, str(e))
        return str(e)
    except Exception as e:  # TookTooLong and MemoryError too
        raise AssertionError(f"{mutation}: {type(e).__name__}: {str(e)[:300]}") from e


def test_the_small_file_is_read(small, tmp_path):
    path = tmp_path / "small.gguf"
    path.write_bytes(small[0])
    assert outcome(path, "none") == "read"


@pytest.mark.parametrize("value", [0, 2 ** 64 - 1, 2 ** 34 + 1])
def test_every_number_of_the_header_at_an_edge_is_read_or_refused(small, tmp_path, value):
    """Each count, length, value type, value, dim, tensor type and offset set in turn to 0, to its width's
    largest (2^32 - 1 or 2^64 - 1), and to 2^34 + 1 (wrapped to its width): a seeded sweep."""
    data, fields, _ = small
    path = tmp_path / "edge.gguf"
    for what in fields:
        path.write_bytes(with_fields(data, fields, {what: value}))
        outcome(path, what)


_INTERESTING = [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 255, 2 ** 16, 2 ** 29, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 34,
                2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


@st.composite
def mutations(draw, fields: dict[str, tuple[int, int]], end: int):
    """A few of the header's numbers set at once, bytes of it overwritten, and the file cut short."""
    edits = draw(st.dictionaries(st.sampled_from(sorted(fields)),
                                 st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2 ** 64 - 1)),
                                 min_size=1, max_size=3))
    pokes = draw(st.lists(st.tuples(st.integers(8, end - 1), st.integers(0, 255)), max_size=2))
    cut = draw(st.one_of(st.none(), st.integers(0, end + 64)))
    return edits, pokes, cut


def mutated(data: bytes, fields, edits: dict[str, int], pokes: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(with_fields(data, fields, edits))
    for pos, byte in pokes:
        out[pos] = byte
    return bytes(out[:cut] if cut is not None else out)


def test_a_mutated_header_is_read_or_refused_in_one_line(small, tmp_path):
    data, fields, end = small
    path = tmp_path / "mutated.gguf"

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutations(fields, end))
    def check(mutation):
        path.write_bytes(mutated(data, fields, *mutation))
        outcome(path, mutation)

    check()


# ---------------------------------------------------------------------------------- the review's crafted files


def crafted(small, tmp_path: Path, name: str, values: dict[str, int]) -> Path:
    data, fields, _ = small
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(with_fields(data, fields, values))
    return path


@pytest.mark.parametrize("name, values, words", [
    # the review's file: an expert tensor of dims (32, 2^29, 2^34), 2^68 elements, whose int64 product is 0
    ("wraps", {f"{EXPERTS} dim 0": 32, f"{EXPERTS} dim 1": 2 ** 29, f"{EXPERTS} dim 2": 2 ** 34}, EXPERTS),
    ("alignment-0", {"general.alignment": 0}, "general.alignment"),
    ("alignment-3", {"general.alignment": 3}, "general.alignment"),
    ("expert-dim-0", {f"{EXPERTS} dim 2": 0}, EXPERTS),
    ("matrix-dim-0", {"blk.1.attn_q.weight dim 0": 0}, "blk.1.attn_q.weight"),
    ("block-count", {f"{ARCH}.block_count": 2 ** 32 - 1}, f"{ARCH}.block_count"),
])
def test_a_crafted_header_exits_2_in_one_line(small, tmp_path, monkeypatch, capsys, name, values, words):
    """`tfq plan --model FILE` exits 2 with one line naming the tensor or key, within 5 s and a GiB."""
    path = crafted(small, tmp_path, name, values)
    with bounded(5.0, 2 ** 30):
        code, out, err = tfq(["plan", "--model", str(path)], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert words in lines[0], lines[0]
