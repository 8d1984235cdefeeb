"""The start-up guard: the loaded model's own decoder layer, head and sampler, proved row-invariant on the
running build at every thread count the engine uses, before a stream runs.

Why a whole layer and not only the kernels: every op of the forward can give a row other bits when other
rows share its call. torch splits an elementwise op into one chunk per thread, and `F.silu` finishes each
chunk's last partial vector with the scalar exp: at 3 threads a row's SiLU bits change with the number of
rows beside it, where 1 and 2 threads never showed it. So the guard runs what the engine runs.

What runs: five probe streams (a first token, a decode deep in a lane, a draft verify on pages, a prompt
chunk from position 0 on pages, a chunk crossing a split in a lane) go through layer 0 of the model with its
real weights, the final norm, the head and the sampler: first each probe alone, then in scenes: all five in
order, reversed, two decode rows, and the largest forward the plan allows (`lanes x prefill_chunk` rows,
filled with other streams' prompt chunks) with the probes first, among the fillers and last. Every
op's output rows (norms, qkv, q/k norm, rotary, cache store, attention, o, residuals, gate_up, the activation,
down, final norm, head), the drawn tokens and their log-probabilities must equal the runs alone bit for bit, and so at
every thread count proved: references are taken once, at the first count. The first op that differs is named. Where the
engine runs a layer in one C++ call (kernels/layer.py), that call runs too, on the same input and cache: alone its
output and cache rows (a DeltaNet layer's: its streams' states) must be those of the layer run op by op, and in every
scene those alone. Where the model's layers run as one object, each proved layer runs as an object of it alone too
(then with the head the object holds), and the proved layers in a row as one object (the passes between two of its
layers), against them op by op.

The proof is remembered on the model (`model.proved`) by its settings, so engines built later on the same
model (every arm of `tfq together`) pay for it once.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import torch

from tfq.decode.sampling import digest, finite
from tfq.engine.batch import Arithmetic, Feed, step_rows
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.guard_draws import drawn_tokens, scores
from tfq.engine.pages import Placement, pages_for
from tfq.errors import TfqError
from tfq.kernels.contract import KEY_TILE
from tfq.kernels.layer import DrawFacts
from tfq.model.layers import DeltaLayer

LANE_WINDOW = 384  # rows of each probe lane: the deepest probe sits at position 300, past a 256-row split


@dataclass(frozen=True)
class Probe:
    name: str
    start: int  # position of its first row
    count: int  # rows it brings to a forward
    lane: bool  # contiguous lane (else pages)
    logits: int  # of its last rows, how many draw

PROBES = (
    Probe("first token", 0, 1, False, 1),
    Probe("decode at 300", 300, 1, True, 1),
    Probe("draft verify", 70, 5, False, 5),
    Probe("prompt chunk", 0, 37, False, 1),
    Probe("chunk at 230", 230, 45, True, 1),
)


@dataclass
class Record:
    """Every tapped op's output rows of each probe in a forward: op name -> probe name -> its rows (a reference
    kept between proofs: their digests, `digested`)."""

    ops: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def digested(self) -> "Record":
        """Each block of rows as the digest of its bits: what later comparisons need, a few bytes instead of the
        rows (17 MB on the default model, whose head rows alone are 0.6 MB each)."""
        return Record({op: {probe: _bits(rows) for probe, rows in rows_of.items()} for op, rows_of in self.ops.items()})


def _bits(rows: torch.Tensor) -> tuple:
    """The rows' dtype, shape and the digest of their bytes (the logits' digest): equal where their bits are."""
    return rows.dtype, tuple(rows.shape), digest(rows)


@dataclass(frozen=True)
class Failure:
    op: str
    probe: str
    scene: str
    threads: int

    def message(self) -> str:
        return (f"this build's {self.op} is not row-invariant at {self.threads} thread"
                f"{'s' * (self.threads != 1)} (the {self.probe} probe's bits change {self.scene}); exact mode "
                f"cannot run at this count: pick another with --threads N (or OMP_NUM_THREADS), or use the torch "
                f"build tfq was measured on")


class _Tap:
    """Keeps the probes' rows of every op it sees (names after `prefix`: a hybrid proves two kinds of layer)."""

    def __init__(self, keep: dict[str, slice], record: Record, prefix: str = ""):
        self.keep, self.record, self.prefix = keep, record, prefix

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.record.ops[self.prefix + name] = {probe: t[rows].float().cpu().clone()
                                               for probe, rows in self.keep.items()}
        return t


class LayerProof:
    """The guard for one model under one cache dtype and attention arithmetic."""

    def __init__(self, model, kv_dtype: str, partial: bool):
        self.model, self.kv_dtype, self.partial = model, kv_dtype, partial
        self.reference: Record | None = None
        self.proved: dict[int, tuple[int, int]] = {}  # thread count -> (most rows, most rows drawing) proved
        self.refused: dict[int, Failure] = {}
        self.seconds = 0.0  # spent proving, in all

    def holds(self, threads: int, rows: int, chunk: int, draws: int = 1) -> Failure | None:
        """Prove the layer at `threads` threads for forwards of up to `rows` rows made of streams' chunks of up
        to `chunk` rows, each stream drawing from up to `draws` rows (a verify: 1 + guesses); once, remembered."""
        if threads in self.refused:
            return self.refused[threads]
        done_rows, done_draws = self.proved.get(threads, (0, 0))
        if done_rows >= rows and done_draws >= draws:
            return None
        t0 = time.perf_counter()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            # a tensor-parallel rank proves its own ops, the other ranks theirs meanwhile (tfq/parallel/model.py)
            with self.model.on_its_own((self.kv_dtype, self.partial, rows, chunk, draws)) as refused:
                failure = self._prove(threads, rows, chunk, draws)
            if refused:
                raise TfqError(refused[0])
        finally:
            torch.set_num_threads(before)
            self.seconds += time.perf_counter() - t0
        if failure is None:
            self.proved[threads] = (rows, draws)
        else:
            self.refused[threads] = failure
        return failure

    # -- the scenes ------------------------------------------------------------------------------------
    def _prove(self, threads: int, rows: int, chunk: int, draws: int) -> Failure | None:
        bench = _Bench(self.model, self.kv_dtype, self.partial, rows, chunk, draws)
        alone = bench.alone()
        heads = {p.name: (alone.ops["head"][p.name], p.start + p.count) for p in PROBES}  # where a token sits
        alone.ops["sampler"] = {name: drawn_tokens(*h) for name, h in heads.items()}  # proved per thread count only
        alone.ops["log-probabilities"] = {name: scores(rows) for name, (rows, _) in heads.items()}
        if self.reference is None:  # references are taken at the first count proved
            self.reference = alone.digested()
        else:
            failure = _compare(self.reference, alone, "from one thread count to another", threads)
            if failure:
                return failure
        probes = list(PROBES)
        scenes = {
            "when all five share a forward": probes,
            "when all five share a forward in reverse order": probes[::-1],
            "beside another decode row": [probes[1], probes[0]],
            f"in a forward of {bench.rows} rows": bench.mixed(),
        }
        for scene, streams in scenes.items():
            failure = _compare(self.reference, bench.run(streams), scene, threads)
            if failure:
                return failure
        return _one_call_agrees(alone, threads)  # last: an op that follows the batch is named above, by its name


ONE_CALL, ONE_CALL_STORE = "layer in one call", "layer in one call's cache store"
STACKED, STACKED_STORE = "layer as the model's one object", "layer as the model's one object's cache store"
CHAIN, CHAIN_BY_OPS = "layers in a row as the model's one object", "layers in a row op by op"
STACKED_HEAD, HEAD_BY_OPS = "head in the model's one object", "head op by op after the one object's layer"
STACKED_FACTS, FACTS_BY_NUMPY = "draw's facts in the model's one object", "draw's facts by numpy"


def _one_call_agrees(record: Record, threads: int) -> Failure | None:
    """Each layer in one call (kernels/layer.py) gives each probe the bits the layer gives op by op: its output
    those of the last residual, its cache rows those of the cache store (a DeltaNet layer: its streams' states
    those of the recurrence); so does the layer run as the model's one object (a Stack of it alone: the
    engine's forward runs every layer so, one after another), its head after it the logits of the final norm and head
    op by op (and, of each logits row, numpy's finite check and argmax: the facts the engine's draw takes), and the
    proved layers in a row as one object give what they give op by op one after another. (Their
    row invariance is then proved with every other op's, scene by scene.)"""
    for call, store in ((ONE_CALL, ONE_CALL_STORE), (STACKED, STACKED_STORE)):
        for name in [op for op in record.ops if op.endswith(call)]:
            prefix = name[:-len(call)]  # a hybrid proves one layer of each kind
            stored = prefix + ("cache store" if prefix + "cache store" in record.ops else "recurrent state")
            for one, by_ops in ((name, prefix + "mlp residual"), (prefix + store, stored)):
                for probe, rows in record.ops[one].items():
                    if not torch.equal(rows, record.ops[by_ops][probe]):
                        return Failure(one, probe, "from those of the layer run op by op", threads)
    pairs = [(op, op[:-len(end)] + by_ops, what) for end, by_ops, what in (
        (STACKED_HEAD, HEAD_BY_OPS, "final norm and head"), (STACKED_FACTS, FACTS_BY_NUMPY, "draw's checks"))
        for op in record.ops if op.endswith(end)] + [(CHAIN, CHAIN_BY_OPS, "layers")] * (CHAIN in record.ops)
    for one, by_ops, what in pairs:  # the head the object holds and what it says of its rows, its layers in a row
        for probe, rows in record.ops[one].items():
            if not torch.equal(rows, record.ops[by_ops][probe]):
                return Failure(one, probe, f"from those of the {what} run op by op", threads)
    return None


def _facts_by_numpy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's (1 if every value is finite else 0, its first largest, or -1) as the engine's draw finds them
    without the object: sampling.finite and numpy's argmax."""
    return torch.tensor([[1, int(r.numpy().argmax())] if finite(r) else [0, -1] for r in logits.cpu()],
                        dtype=torch.int64).reshape(-1, 2)


def _kept_nowhere(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tap that keeps nothing: a layer given it runs op by op (an untapped one runs in one call)."""
    return t


def _compare(reference: Record, got: Record, scene: str, threads: int) -> Failure | None:
    for op, want in reference.ops.items():  # in forward order: the first op that differs is the culprit
        for probe, rows in got.ops.get(op, {}).items():
            if _bits(rows) != want[probe]:
                return Failure(op, probe, scene, threads)
    return None


Stream = Probe  # a filler is a stream like a probe, only never compared


class _Bench:
    """A one-layer cache holding every stream of the scenes, reset before each forward."""

    def __init__(self, model, kv_dtype: str, partial: bool, rows: int, chunk: int, draws: int):
        self.model, self.partial = model, partial
        probe_rows = sum(p.count for p in PROBES)
        self.rows = max(rows, probe_rows)
        self.fillers: list[Stream] = []  # other streams' prompt chunks, up to the largest forward
        left, i = self.rows - probe_rows, 0
        while left > 0:
            n = min(left, chunk)
            self.fillers.append(Stream(f"filler {i}", 0, n, False, min(n, draws)))  # the head sees every drawing row
            left, i = left - n, i + 1
        paged = [s for s in list(PROBES) + self.fillers if not s.lane]
        pages = sum(pages_for(s.start + s.count, KEY_TILE) for s in paged)
        c = model.config
        # one layer of each kind the model has: a hybrid's first attention layer and first DeltaNet layer, the
        # first with a mixture of experts where there are some (a dense MLP is the same kernels as the experts')
        firsts = [(kind, next((i for i in layers if i in c.moe_layers), layers[0]))
                  for kind, layers in (("full_attention", c.attention_layers), ("linear_attention", c.deltanet_layers))
                  if layers]
        self.layers = [(model.layers[i], f"{'attention' if kind == 'full_attention' else 'deltanet'}: "
                        if c.hybrid else "") for kind, i in firsts]
        # where the model runs its layers as one object, that object's code on each proved layer alone (a
        # mixture's layer where the model has one; a hybrid's attention and DeltaNet layers)
        self.stacks = [model.stack_of([layer]) for layer, _ in self.layers] if model.runs_as_stack() else []
        # and those layers in a row as one object, a dense layer among mixtures next (mlp_only_layers), the first
        # again last (a hybrid's attention, DeltaNet, attention), so the passes between two layers of the object run
        # too: a layer's residual with the next one's input norm
        dense = [layer for layer in model.layers if layer.moe is None][:1] if c.moe_layers else []
        self.chain = [layer for layer, _ in self.layers] + dense + [self.layers[0][0]]
        stacked = bool(self.stacks) and all(self.stacks)
        self.chain_stack = model.stack_of(self.chain) if stacked else None
        if stacked and self.chain_stack is None:
            raise TfqError("the start-up guard could not build its proved layers in a row as one object, which "
                           "the model runs; set TFQ_CPU_KERNELS=torch to run without tfq's kernels")
        config = replace(c, num_layers=len(firsts), layer_types=tuple(k for k, _ in firsts) if c.hybrid else ())
        streams = list(PROBES) + self.fillers
        self.cache = KVCache(config, CacheSpec(lanes=2, window=LANE_WINDOW, page_rows=KEY_TILE, pool_pages=pages,
                                               dtype=kv_dtype, slots=len(streams),
                                               verify_rows=max(draws, max(p.count for p in PROBES))),
                             page_order_seed=11, backend=model.backend)
        self.places: dict[str, Placement] = {}
        lanes = iter(range(2))
        for slot, s in enumerate(streams):
            place = self.cache.pages.lane(next(lanes)) if s.lane else self.cache.pages.paged()
            place.slot = slot  # a hybrid's state: each stream its own
            if not self.cache.pages.grow(place, s.start + s.count):
                raise AssertionError(f"guard cache too small for {s.name}")
            self.places[s.name] = place
        dev = model.backend.device
        state = self.cache.state
        for i, st in enumerate(streams):  # old keys and values each stream attends to (and its past state)
            g = torch.Generator().manual_seed(2024 + i)  # the same in every bench, whatever its pool
            n = st.start + st.count
            k, v = (torch.randn(n, c.num_kv_heads, c.head_dim, generator=g).to(dev) for _ in range(2))
            if self.cache.k:  # a hybrid may have no attention layer
                self.cache.write(0, self.cache.rows(self.places[st.name], 0, n), k, v)
            if state is not None:
                state.conv[0][i] = torch.randn(state.conv[0][i].shape, generator=g)
                state.rec[0][i] = 0.1 * torch.randn(state.rec[0][i].shape, generator=g)
        self.saved = self.cache.k + self.cache.v + (state.conv + state.rec if state is not None else [])
        self.snapshot = [t.clone() for t in self.saved]
        vocab = model.config.vocab_size
        gen = random.Random(5)
        self.tokens = {s.name: [gen.randrange(vocab) for _ in range(s.count)] for s in list(PROBES) + self.fillers}

    def mixed(self) -> list[Stream]:
        """The largest forward: probes spread among the fillers, first, inside and last, in another order."""
        order = [PROBES[i] for i in (3, 0, 4, 2)]
        streams: list[Stream] = [order[0]]
        for i, filler in enumerate(self.fillers):
            streams.append(filler)
            if i + 1 < len(order):
                streams.append(order[i + 1])
        streams += [p for p in order if p not in streams] + [PROBES[1]]
        return streams

    def alone(self) -> Record:
        records = [self.run([p], chain_by_ops=True) for p in PROBES]
        return Record({op: {p.name: r.ops[op][p.name] for p, r in zip(PROBES, records)} for op in records[0].ops})

    def run(self, streams: list[Stream], chain_by_ops: bool = False) -> Record:
        """One forward of `streams` through layer 0, the head and the sampler; the probes' rows kept. The layers in
        a row run op by op too where `chain_by_ops` (the reference of their one object, needed alone only)."""
        self.restore()
        feeds = [Feed(self.places[s.name], s.start, self.tokens[s.name], s.logits,
                      guesses=s.count - 1 if s.logits == s.count > 1 else 0) for s in streams]
        s = step_rows(self.cache, feeds, Arithmetic(self.partial))
        probes = {p.name for p in PROBES}
        keep, keep_logits, row, logit_row = {}, {}, 0, 0
        for st in streams:
            if st.name in probes:
                keep[st.name] = slice(row, row + st.count)
                keep_logits[st.name] = slice(logit_row, logit_row + st.logits)
            row, logit_row = row + st.count, logit_row + st.logits
        record = Record()
        model, dev = self.model, self.model.backend.device
        with torch.inference_mode():
            cos, sin = model._rope(s.positions.to(dev))
            x0 = model.embedding(s.ids.to(dev))
            for layer, prefix in self.layers:
                x = model.decoder_layer(layer, x0, cos, sin, self.cache, 0, s.cache_rows, s.batch,
                                        _Tap(keep, record, prefix), segments=s.segments)
            model.logits(x[s.logit_rows.to(dev)], _Tap(keep_logits, record))
            self.restore()  # what the engine runs: the same layers in one call, from the same cache and states
            for layer, prefix in self.layers:
                if model.runs_in_one_call(layer):
                    tap = _Tap(keep, record, prefix)
                    tap(ONE_CALL, model.one_call(layer, x0, cos, sin, self.cache, 0, s.cache_rows, s.batch,
                                                 s.segments))
                    tap(ONE_CALL_STORE, self.cache.state.fingerprint(0, s.segments, x0.shape[0])
                        if isinstance(layer, DeltaLayer) else self.cache.stored(0, s.cache_rows))
            for (layer, prefix), stack in zip(self.layers, self.stacks):  # each as a Stack of it alone
                if stack is None:
                    continue
                self.restore()
                tap = _Tap(keep, record, prefix)
                inputs = model.stack_inputs([layer], [0], self.cache, (cos, sin), s.cache_rows, s.batch, s.segments)
                x = tap(STACKED, model.run_stack(stack, [layer], x0, inputs, s.segments))
                tap(STACKED_STORE, self.cache.state.fingerprint(0, s.segments, x0.shape[0])
                    if isinstance(layer, DeltaLayer) else self.cache.stored(0, s.cache_rows))
                if stack.head:  # its head after this layer, as the engine's forward runs it after the last
                    head = _Tap(keep_logits, record, prefix)
                    head(HEAD_BY_OPS, model.logits(x.index_select(0, s.logit_rows)))
                    self.restore()
                    facts = DrawFacts.blank(s.logit_rows.shape[0], 1)
                    logits = head(STACKED_HEAD, model.run_stack(stack, [layer], x0, inputs, s.segments, s.logit_rows,
                                                                facts))
                    head(STACKED_FACTS, facts.table[:, :2].clone())
                    head(FACTS_BY_NUMPY, _facts_by_numpy(logits))
            if self.chain_stack is not None:  # each kind's cache layer 0 again for each of its layers in the row
                tap = _Tap(keep, record)
                if chain_by_ops:
                    self.restore()
                    x = x0
                    for layer in self.chain:
                        x = model.decoder_layer(layer, x, cos, sin, self.cache, 0, s.cache_rows, s.batch, _kept_nowhere,
                                                segments=s.segments)
                    tap(CHAIN_BY_OPS, x)
                self.restore()
                tap(CHAIN, model.run_stack(self.chain_stack, self.chain, x0, model.stack_inputs(
                    self.chain, [0] * len(self.chain), self.cache, (cos, sin), s.cache_rows, s.batch, s.segments),
                    s.segments))
        return record

    def restore(self) -> None:
        for t, saved in zip(self.saved, self.snapshot):
            t.copy_(saved)


def prove(model, kv_dtype: str, partial: bool, threads: int, rows: int, chunk: int, draws: int = 1) -> LayerProof:
    """The model's proof for these settings, proved at `threads` for forwards of up to `rows` rows (streams'
    chunks of up to `chunk` rows); raises TfqError naming the op and the thread count where a row's bits
    depend on its batch."""
    proof = model.proved.setdefault((kv_dtype, partial), LayerProof(model, kv_dtype, partial))
    failure = proof.holds(threads, rows, chunk, draws)
    if failure is not None:
        raise TfqError(failure.message())
    return proof
