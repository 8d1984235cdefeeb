"""tfq's C++ kernels check the indices and shapes they trust, once a call and before any thread runs: a cache row
past the cache, a key table entry past the pool, a slot past the states, a weight of the wrong size is a
RuntimeError naming the op and the bound, never a write or a read past the memory (issue 46, point 12).

Each test hands one kernel a bad index or shape, and first the same call with everything in range (it runs)."""
from __future__ import annotations

import struct

import pytest
import torch

from tfq.kernels import cpu_build

pytestmark = pytest.mark.skipif(not cpu_build.load()[0], reason="tfq's CPU kernels do not build here")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, CACHE_ROWS = 32, 2, 1, 16, 32, 128
Q_OUT, KV_OUT = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def op(name: str):
    return cpu_build.op(name)


def pack(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return op("pack")((torch.randn(rows, cols, generator=g) / cols ** 0.5).contiguous())


def layer_args(n: int = 2) -> dict:
    """A valid call of the one-call layer: n rows of one stream at positions 0 .. n-1, keys at cache rows 5 ..,
    its key table one tile of the cache's rows."""
    g = torch.Generator().manual_seed(0)
    rows = torch.arange(5, 5 + n)
    table = torch.arange(5, 5 + 64)
    return dict(
        x=torch.randn(n, HIDDEN, generator=g), input_norm=torch.ones(HIDDEN), qkv=pack(Q_OUT + 2 * KV_OUT, HIDDEN, 1),
        qkv_bias=None, q_norm=None, k_norm=None, cos=torch.ones(n, 1, HEAD_DIM), sin=torch.zeros(n, 1, HEAD_DIM),
        k_cache=torch.zeros(CACHE_ROWS, KV_HEADS, HEAD_DIM), v_cache=torch.zeros(CACHE_ROWS, KV_HEADS, HEAD_DIM),
        rows=rows, saturate=0.0, table=table, offsets=torch.zeros(n, dtype=torch.long),
        lengths=torch.arange(1, n + 1), scale=HEAD_DIM ** -0.5, tile=64, split=0, o=pack(HIDDEN, Q_OUT, 2),
        post_norm=torch.ones(HIDDEN), gate_up=pack(2 * INTER, HIDDEN, 3), down=pack(HIDDEN, INTER, 4), heads=HEADS,
        kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate=INTER, eps=1e-6, gated=False, clock=None)


def attention_layer_args(n: int = 2) -> dict:
    args = layer_args(n)
    for name in ("gate_up", "down", "intermediate"):
        del args[name]
    return args


def attend_args(n: int = 2) -> dict:
    a = layer_args(n)
    g = torch.Generator().manual_seed(5)
    return dict(q=torch.randn(n, HEADS, HEAD_DIM, generator=g), k_cache=torch.randn(CACHE_ROWS, KV_HEADS, HEAD_DIM,
                generator=g), v_cache=torch.randn(CACHE_ROWS, KV_HEADS, HEAD_DIM, generator=g), table=a["table"],
                offsets=a["offsets"], lengths=a["lengths"], scale=a["scale"], tile=64, split=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", [CACHE_ROWS, CACHE_ROWS + 1000, -1])
def test_the_layer_refuses_a_cache_row_past_the_cache(row, dtype):
    """rotary_store writes a row's keys and values at rows[r] in an fp32 cache; a narrow cache's store is torch's
    index_put_, which took -1 as the last row (another stream's)"""
    args = layer_args()
    args["k_cache"], args["v_cache"] = args["k_cache"].to(dtype), args["v_cache"].to(dtype)
    op("layer")(**args)
    args["rows"] = torch.tensor([5, row])
    with pytest.raises(RuntimeError, match=rf"tfq layer: rows\[1\] = {row} is outside the {CACHE_ROWS} cache rows"):
        op("layer")(**args)


@pytest.mark.parametrize("entry", [CACHE_ROWS, 10 ** 9, -3])
def test_attend_refuses_a_key_table_entry_past_the_pool(entry):
    args = attend_args()
    op("attend")(**args)
    table = args["table"].clone()
    table[1] = entry  # the second key, which both rows read
    args["table"] = table
    with pytest.raises(RuntimeError, match=rf"tfq attend: table\[1\] = {entry}\b.*{CACHE_ROWS} cache rows"):
        op("attend")(**args)


@pytest.mark.parametrize("name", ["layer", "attention_layer"])
def test_the_layer_refuses_a_key_table_entry_past_the_pool(name):
    args = layer_args() if name == "layer" else attention_layer_args()
    op(name)(**args)
    table = args["table"].clone()
    table[0] = CACHE_ROWS + 7
    args["table"] = table
    with pytest.raises(RuntimeError, match=rf"tfq attend: table\[0\] = {CACHE_ROWS + 7}\b"):
        op(name)(**args)


@pytest.mark.parametrize("offsets, lengths", [([0, 60], [1, 5]), ([-1, 0], [1, 2]), ([0, 0], [1, 65]),
                                              ([0, 0], [-1, 2]), ([0, 0], [0, 0])])
def test_attend_refuses_a_row_whose_keys_run_past_its_table(offsets, lengths):
    """row n reads table[offsets[n] : offsets[n] + lengths[n]]: that span must lie inside the table, and hold one
    key at least (the row's own; a block of rows of no keys divided by zero)"""
    args = attend_args()
    op("attend")(**args)
    args["offsets"], args["lengths"] = torch.tensor(offsets), torch.tensor(lengths)
    with pytest.raises(RuntimeError, match=r"tfq attend: row \d('s keys .*table of 64| attends to -?\d keys)"):
        op("attend")(**args)


@pytest.mark.parametrize("what", ["head_dim", "v_cache", "offsets", "no kv heads", "tile 0"])
def test_attend_refuses_shapes_that_do_not_match(what):
    args = attend_args()
    op("attend")(**args)
    if what == "no kv heads":  # heads % 0
        args["k_cache"], args["v_cache"] = torch.zeros(CACHE_ROWS, 0, HEAD_DIM), torch.zeros(CACHE_ROWS, 0, HEAD_DIM)
    elif what == "tile 0":  # a tile loop that never advances
        args["tile"] = 0
    elif what == "head_dim":  # queries of 16 dimensions over keys of 32: each key's row read 32 wide
        args["k_cache"] = torch.zeros(CACHE_ROWS // 2, KV_HEADS, 2 * HEAD_DIM)
        args["v_cache"] = torch.zeros(CACHE_ROWS // 2, KV_HEADS, 2 * HEAD_DIM)
        args["table"] = args["table"] - 5  # in range of the smaller cache: only the shape is wrong
    elif what == "v_cache":
        args["v_cache"] = torch.zeros(CACHE_ROWS // 2, KV_HEADS, HEAD_DIM)
    else:
        args["offsets"] = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"tfq attend: .*(head|v_cache|offsets|KV heads|tile)"):
        op("attend")(**args)


@pytest.mark.parametrize("size", [HIDDEN - 16, HIDDEN + 16])
@pytest.mark.parametrize("name", ["layer", "attention_layer"])
def test_add_norm_refuses_a_norm_of_another_size(name, size):
    """add_norm (the residual with the post norm) took its row width from the norm's weights: a longer norm wrote
    past the rows, a shorter one normed the wrong spans"""
    args = layer_args() if name == "layer" else attention_layer_args()
    op(name)(**args)
    args["post_norm"] = torch.ones(size)
    with pytest.raises(RuntimeError, match=rf"tfq layer: add_norm's norm has {size} weights for {HIDDEN} inputs"):
        op(name)(**args)


@pytest.mark.parametrize("what", ["kv_heads", "cos", "q_norm"])
def test_the_layer_refuses_a_cache_or_rotary_of_another_shape(what):
    args = layer_args()
    op("layer")(**args)
    if what == "kv_heads":  # rows of 2 heads in the cache, 1 in the layer: the store's rows would be half as wide
        args["k_cache"] = torch.zeros(CACHE_ROWS // 2, 2, HEAD_DIM)
        args["v_cache"] = torch.zeros(CACHE_ROWS // 2, 2, HEAD_DIM)
        args["table"] = args["table"] - 5
        match = r"tfq layer: .*cache"
    elif what == "cos":  # one row of cos and sin for two rows of queries
        args["cos"], args["sin"] = args["cos"][:1].contiguous(), args["sin"][:1].contiguous()
        match = r"tfq layer: .*cos"
    else:  # q norm without a k norm
        args["q_norm"] = torch.ones(HEAD_DIM)
        match = r"tfq layer: .*q_norm and k_norm"
    with pytest.raises(RuntimeError, match=match):
        op("layer")(**args)


def test_the_layer_refuses_a_clock_too_short_for_its_slots():
    """the layer adds its linear and attention seconds to clock[0] and clock[1]"""
    args = layer_args()
    args["clock"] = torch.zeros(2, dtype=torch.float64)
    op("layer")(**args)
    args["clock"] = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"tfq clock: .*slot 1"):
        op("layer")(**args)


@pytest.mark.parametrize("size", [1, 63, 65])
def test_linear_refuses_a_bias_of_another_size(size):
    x, panels = torch.randn(3, HIDDEN), pack(64, HIDDEN, 7)
    op("linear")(x, panels, torch.zeros(64), 64)
    with pytest.raises(RuntimeError, match=rf"tfq linear: the bias has {size} weights for 64 outputs"):
        op("linear")(x, panels, torch.zeros(size), 64)


def blob(k: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (64, k), generator=g, dtype=torch.uint8)
    return op("qpack")(q, torch.rand(64, k // 32, generator=g), None, 4, 32, 8)


HEADER_FIELDS = {"group": (8, "<i"), "k": (32, "<q"), "panels": (40, "<q"), "group_bytes": (48, "<i"),
                 "panel_bytes": (56, "<q")}  # quant_blob.h's Header


@pytest.mark.parametrize("changes", [{"k": 128}, {"group": 0}, {"group_bytes": 1 << 20},
                                     {"panels": -1, "panel_bytes": -2560}, {"panels": -1}],
                         ids=["more inputs", "no group", "wider groups", "negative sizes", "negative panels"])
def test_qlinear_refuses_a_blob_whose_header_does_not_match_its_panels(changes):
    """qlinear reads a blob's panels as its header says: a header that says more inputs or wider groups than the
    panels hold reads past the blob; negative sizes whose product is the blob's size leave the outputs unwritten
    (one panel: 2 groups of 1280 bytes); negative panels read a header before the blob"""
    b = blob()
    op("qlinear")(torch.randn(2, 64), b, None, 64)
    raw = bytearray(b.numpy().tobytes())
    for field, value in changes.items():
        offset, fmt = HEADER_FIELDS[field]
        raw[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    bad = torch.frombuffer(raw, dtype=torch.uint8).clone()
    x = torch.randn(2, changes.get("k", 64))
    with pytest.raises(RuntimeError, match=r"tfq qlinear: the blob's segment 0 .*(does not match|holds)"):
        op("qlinear")(x, bad, None, 64)


@pytest.mark.parametrize("bits", [4, 8])
def test_qpack_q8_refuses_groups_its_kernel_does_not_take(bits):
    """quant_q8.cpp's tile sums 4, 5 and 8 bits in groups of 32 (6 bits: 16), whatever the header says: 4 bits in
    groups of 16 were packed, then summed as groups of 32 (a relative error of 1.6 against the dequantized product,
    measured before this check). Control: groups of 32 pack."""
    g = torch.Generator().manual_seed(15)
    q = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    op("qpack_q8")(q, torch.rand(16, 2, generator=g), None, bits, 32, 8)
    with pytest.raises(RuntimeError, match=r"tfq qpack_q8: 4, 5 or 8 bits in groups of 32"):
        op("qpack_q8")(q, torch.rand(16, 4, generator=g), None, bits, 16, 8)


def delta_args(n: int = 3, slots: int = 2) -> dict:
    kh, kd, vh, vd, kernel = 1, 16, 2, 16, 4
    c = 2 * kh * kd + vh * vd
    g = torch.Generator().manual_seed(9)
    return dict(x=torch.randn(n, c, generator=g), a=torch.randn(n, vh, generator=g), b=torch.randn(n, vh, generator=g),
                conv_w=torch.randn(kernel, c, generator=g), A=-torch.rand(vh, generator=g),
                dt_bias=torch.rand(vh, generator=g), conv_state=torch.zeros(slots, kernel - 1, c),
                rec_state=torch.zeros(slots, vh, kd, vd),
                segments=torch.tensor([[0, n, 1, 1, 0]]), save_conv=torch.empty(0), save_rec=torch.empty(0),
                key_heads=kh, key_dim=kd, value_heads=vh, value_dim=vd)


@pytest.mark.parametrize("segment, match", [([0, 3, 2, 1, 0], r"slot 2 .*2 slots"), ([0, 3, -1, 1, 0], r"slot -1"),
                                            ([1, 3, 0, 1, 0], r"rows 1 \.\. 4 .*3 rows"),
                                            ([0, -2, 0, 1, 0], r"rows 0 \.\. -2")])
def test_deltanet_refuses_a_segment_past_its_rows_or_the_states(segment, match):
    args = delta_args()
    op("deltanet")(**args)
    args["segments"] = torch.tensor([segment])
    with pytest.raises(RuntimeError, match=rf"tfq deltanet: segment 0's {match}"):
        op("deltanet")(**args)


@pytest.mark.parametrize("what", ["rec_state", "conv_state", "A", "a", "conv_w"])
def test_deltanet_refuses_states_and_weights_of_another_shape(what):
    args = delta_args()
    op("deltanet")(**args)
    args[what] = {"rec_state": torch.zeros(2, 2, 16, 8), "conv_state": torch.zeros(2, 3, 32),
                  "A": -torch.rand(1), "a": torch.randn(3, 1), "conv_w": torch.randn(0, 64)}[what]
    with pytest.raises(RuntimeError, match=r"tfq deltanet: "):
        op("deltanet")(**args)


def test_delta_layer_refuses_a_slot_past_the_states_and_a_norm_of_another_size():
    d = delta_args()
    kh, kd, vh, vd = d["key_heads"], d["key_dim"], d["value_heads"], d["value_dim"]
    channels, values = 2 * kh * kd + vh * vd, vh * vd
    g = torch.Generator().manual_seed(10)
    args = dict(x=torch.randn(3, HIDDEN, generator=g), input_norm=torch.ones(HIDDEN),
                in_proj=pack(channels + values + 2 * vh, HIDDEN, 11), conv=d["conv_w"], A=d["A"], dt_bias=d["dt_bias"],
                norm=torch.ones(vd), conv_state=d["conv_state"], rec_state=d["rec_state"], segments=d["segments"],
                save_conv=d["save_conv"], save_rec=d["save_rec"], key_heads=kh, key_dim=kd, value_heads=vh,
                value_dim=vd, out_proj=pack(HIDDEN, values, 12), post_norm=torch.ones(HIDDEN),
                gate_up=pack(2 * INTER, HIDDEN, 13), down=pack(HIDDEN, INTER, 14), intermediate=INTER, eps=1e-6,
                clock=None)
    op("delta_layer")(**args)
    with pytest.raises(RuntimeError, match=r"tfq deltanet: segment 0's slot 5"):
        op("delta_layer")(**{**args, "segments": torch.tensor([[0, 3, 5, 1, 0]])})
    with pytest.raises(RuntimeError, match=rf"tfq layer: add_norm's norm has {HIDDEN + 16} weights for {HIDDEN}"):
        op("delta_layer")(**{**args, "post_norm": torch.ones(HIDDEN + 16)})


def bank():
    from tfq.kernels.moe import expert_bank

    return expert_bank([pack(2 * INTER, HIDDEN, 20 + e) for e in range(3)],
                       [pack(HIDDEN, INTER, 30 + e) for e in range(3)])


def test_moe_mixture_refuses_rows_with_no_expert_and_a_clock_too_short():
    """each row's output starts from its first route's: a row must have one; experts' seconds go to clock[2]"""
    b, h = bank(), torch.randn(2, HIDDEN)
    ids, weights = torch.tensor([[0, 2], [1, 2]]), torch.full((2, 2), 0.5)
    op("moe_mixture")(h, ids, weights, b, INTER, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"tfq moe_mixture: .*at least one expert"):
        op("moe_mixture")(h, ids[:, :0], weights[:, :0], b, INTER, None)
    with pytest.raises(RuntimeError, match=r"tfq clock: .*slot 2"):
        op("moe_mixture")(h, ids, weights, b, INTER, torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("expert", [3, -1])
def test_moe_mixture_still_refuses_an_expert_id_past_the_bank(expert):
    """(refused before this file too: the check now goes through the kernels' shared index check)"""
    b, h, weights = bank(), torch.randn(2, HIDDEN), torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match=rf"tfq moe_mixture: .*{expert}.*3 experts|expert id past the list"):
        op("moe_mixture")(h, torch.tensor([[0, 2], [1, expert]]), weights, b, INTER, None)


def test_a_mixture_stack_refuses_experts_it_cannot_split_and_a_layer_past_its_own():
    """a Stack's layer with a router takes the next `experts` experts of the flat lists: too few or too many is
    refused when it is built, and so are shared experts other than three tensors a mixture; a forward from a layer
    past the stack's is refused. In range, it runs the layer's per-layer calls' bits (attention_layer, the router,
    moe_route, moe_mixture, the residual), a shared expert's gated output added to the mixture's before the
    residual (Qwen3.5: tfq/model/moe.py, moe_mlp)."""
    from tfq.kernels.moe import expert_bank

    a = attention_layer_args()
    gate_ups = [pack(2 * INTER, HIDDEN, 20 + e) for e in range(3)]
    downs = [pack(HIDDEN, INTER, 30 + e) for e in range(3)]
    sizes = [HEADS, KV_HEADS, HEAD_DIM, INTER, 3, 2, INTER, 1, 0, 0, 0, 0]  # 3 experts, 2 chosen, normalized
    router = pack(3, HIDDEN, 40)
    shared = [pack(2 * INTER, HIDDEN, 50), pack(HIDDEN, INTER, 51), pack(1, HIDDEN, 52)]  # gate_up, down, gate

    def stack(g: list, d: list, s: list = ()):  # one layer, its MLP a mixture (no dense gate_up or down)
        none = torch.empty(0)
        return torch.classes.tfq_cpu.Stack([a["input_norm"]], [a["qkv"]], [], [], [], [a["o"]], [a["post_norm"]],
                                           [none], [none], [router], g, d, list(s), [], [],
                                           [*sizes, INTER if s else 0, 0], 1e-6, a["scale"], False)

    caches = torch.classes.tfq_cpu.Caches([a["k_cache"]], [a["v_cache"]], [], [], [], [])
    forward = dict(x=a["x"], cos=a["cos"], sin=a["sin"], caches=caches.id(), rows=a["rows"], saturate=0.0,
                   table=a["table"],
                   offsets=a["offsets"], lengths=a["lengths"], tile=64, split=0,
                   segments=torch.empty(0, 5, dtype=torch.int64), clock=torch.zeros(3, dtype=torch.float64))
    one = stack(gate_ups, downs)
    out, layer, h = op("stack_forward")(stack=one.id(), first=0, **forward)
    x2, h2 = op("attention_layer")(**a)
    ids, weights, unsure = op("moe_route")(op("linear")(h2, router, None, 3), 2, True)
    assert layer == 1 and h.numel() == 0 and len(unsure) == 0
    mixture = op("moe_mixture")(h2, ids, weights, expert_bank(gate_ups, downs), INTER, None)
    assert torch.equal(out, x2 + mixture)
    with_shared = stack(gate_ups, downs, shared)  # held: a Stack goes with its last reference
    out, layer, h = op("stack_forward")(stack=with_shared.id(), first=0, **forward)
    gu = op("linear")(h2, shared[0], None, 2 * INTER)
    expert = op("linear")(op("silu")(gu[:, :INTER].contiguous()) * gu[:, INTER:], shared[1], None, HIDDEN)
    gate = op("linear")(h2, shared[2], None, 1).expand(-1, HIDDEN).contiguous()
    assert layer == 1 and torch.equal(out, x2 + (mixture + op("sigmoid_gate")(expert, gate)))
    assert not torch.equal(out, x2 + mixture)
    with pytest.raises(RuntimeError, match=r"tfq Stack: shared experts: none, or three tensors a mixture"):
        stack(gate_ups, downs, shared[:2])
    with pytest.raises(RuntimeError, match=r"tfq Stack: layer 0 has a router but not 3 experts to choose 2 from"):
        stack(gate_ups[:2], downs[:2])
    with pytest.raises(RuntimeError, match=r"tfq Stack: 4 experts, 3 for the layers with a router"):
        stack(gate_ups + gate_ups[:1], downs + downs[:1])
    with pytest.raises(RuntimeError, match=r"tfq stack_forward: no layer 2 in 1"):
        op("stack_forward")(stack=one.id(), first=2, **forward)
    freed = stack(gate_ups, downs).id()  # the object went with its last reference: its id names nothing
    with pytest.raises(RuntimeError, match=rf"tfq stack_forward: no Stack {freed} \(freed, or never made\)"):
        op("stack_forward")(stack=freed, first=0, **forward)


def test_a_stack_with_a_head_gives_its_logit_rows_logits_and_one_without_refuses_them():
    """A Stack holding the model's final norm and head runs them after its last layer over the logit rows it is
    given: the bits of rms_norm then linear on those rows of its output (every row in order: no gather; one row:
    its own). A Stack without a head refuses logit rows; a head without its vocab is refused when it is built."""
    a = layer_args(3)
    vocab, norm, head = 40, torch.linspace(0.5, 1.5, HIDDEN), pack(40, HIDDEN, 60)

    def stack(held: list, size: int):  # one dense layer
        return torch.classes.tfq_cpu.Stack([a["input_norm"]], [a["qkv"]], [], [], [], [a["o"]], [a["post_norm"]],
                                           [a["gate_up"]], [a["down"]], [], [], [], [], [], held,
                                           [HEADS, KV_HEADS, HEAD_DIM, INTER, 0, 0, 0, 0, 0, 0, 0, 0, 0, size],
                                           a["eps"], a["scale"], False)

    caches = torch.classes.tfq_cpu.Caches([a["k_cache"]], [a["v_cache"]], [], [], [], [])
    forward = dict(x=a["x"], first=0, cos=a["cos"], sin=a["sin"], caches=caches.id(), rows=a["rows"], saturate=0.0,
                   table=a["table"], offsets=a["offsets"], lengths=a["lengths"], tile=64, split=0,
                   segments=torch.empty(0, 5, dtype=torch.int64), clock=None)
    headless, held = stack([], 0), stack([norm, head], vocab)
    out = op("stack_forward")(stack=headless.id(), **forward)[0]
    for rows in ([2], [0, 1, 2], [2, 0]):
        logit_rows = torch.tensor(rows)
        got, layer, _ = op("stack_forward")(stack=held.id(), logit_rows=logit_rows, **forward)
        want = op("linear")(op("rms_norm")(out.index_select(0, logit_rows), norm, a["eps"]), head, None, vocab)
        assert layer == 1 and got.shape == (len(rows), vocab) and torch.equal(got, want), rows
        other = op("linear")(op("rms_norm")(out.index_select(0, logit_rows), norm.flip(0), a["eps"]), head, None,
                             vocab)
        assert not torch.equal(got, other)  # control: another final norm gives other logits
    with pytest.raises(RuntimeError, match=r"tfq stack_forward: logit rows for a Stack without a head"):
        op("stack_forward")(stack=headless.id(), logit_rows=torch.tensor([0]), **forward)
    with pytest.raises(RuntimeError, match=r"tfq Stack: a head is its final norm and panels, with its vocab"):
        stack([norm, head], 0)
