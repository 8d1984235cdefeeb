"""The kernel check's attention bench: one backend and cache dtype, streams of ragged lengths written into one
KVCache twice (contiguous lanes, shuffled pages) between guard canaries, and the stores, keep, queries, rows
and control cases described in kernel_check.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.pages import Placement
from tfq.kernels.attention import AttentionBatch, Chunk, DecodeGroup, tile_count
from tfq.kernels.backend import Backend
from tfq.kernels.contract import KEY_TILE, SATURATE, SPLIT_ROWS
from tfq.model.config import ModelConfig
from tfq.proofs.case import Case, same_bits
from tfq.proofs.kernel_check_bounds import attention_bound, edge_values, reference
from tfq.proofs.kernel_check_config import CheckConfig

STORE_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8": 2.0 ** -4}
MIN_NORMAL = {"fp32": 2.0 ** -126, "bf16": 2.0 ** -126, "fp16": 2.0 ** -14, "fp8": 2.0 ** -6}
CANARY_K, CANARY_V = 240.0, -208.0  # exact in every cache dtype, far from the data: a leak shows
EDGE_ROWS = 16  # a stream written with rounding edge cases (ties, subnormals, overflow), stores only


@dataclass
class Stream:
    length: int
    k: torch.Tensor  # [L, Hkv, D] fp32, the keys a model would write
    v: torch.Tensor
    q: torch.Tensor | None  # [L, H, D] fp32 (None: a stores-only stream)
    lane: Placement
    paged: Placement
    stored: tuple[torch.Tensor, torch.Tensor] | None = None  # float64 K, V as read back from the cache


@dataclass
class Measure:
    """What one kernel run gave: outputs of every repeat (on the CPU) for the lanes and the pages."""

    lane: list[torch.Tensor] = field(default_factory=list)
    paged: list[torch.Tensor] = field(default_factory=list)
    guards_ok: bool = True


class Bench:
    """One backend and cache dtype: a KVCache with guard lanes and pages around the streams' own."""

    def __init__(self, cfg: CheckConfig, backend: Backend, dtype: str):
        self.cfg, self.backend, self.dtype = cfg, backend, dtype
        g = torch.Generator().manual_seed(cfg.seed)
        lengths = list(cfg.lengths) + [EDGE_ROWS]
        window = tile_count(max(lengths) + 1) * KEY_TILE  # room for the off-by-one control's key
        need = sum(-(-n // cfg.page_rows) for n in lengths)
        config = ModelConfig(family="qwen3", vocab_size=1, hidden_size=cfg.heads * cfg.head_dim, intermediate_size=1,
                             num_layers=1, num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                             rope_theta=1e6, rms_eps=1e-6, max_positions=window, tie_embeddings=True,
                             weights_dtype="float32")
        self.cache = KVCache(config, CacheSpec(lanes=2 * len(lengths) + 1, window=window, page_rows=cfg.page_rows,
                                               pool_pages=2 * need + 1, dtype=dtype), backend=backend)
        # streams get the odd lanes and odd pages (in shuffled order): every lane and page sits between guards
        pages = list(range(1, 2 * need + 1, 2))
        random.Random(cfg.seed).shuffle(pages)
        self.cache.pages.free = pages
        shape = (cfg.kv_heads, cfg.head_dim)
        self.streams: list[Stream] = []
        for i, n in enumerate(lengths):
            paged = self.cache.pages.paged()
            self.cache.pages.grow(paged, n)
            if i < len(cfg.lengths):
                k, v = torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)
                q = torch.randn(n, cfg.heads, cfg.head_dim, generator=g)
            else:
                k = edge_values(dtype, n * cfg.kv_heads * cfg.head_dim, g).view(n, *shape)
                v, q = -k.flip(0), None
            self.streams.append(Stream(n, k, v, q, self.cache.pages.lane(2 * i + 1), paged))
        dev = backend.device
        owned = torch.zeros(self.cache.rows_total, dtype=torch.bool)
        for s in self.streams:
            owned[self.cache.rows(s.lane, 0, s.length)] = True
            owned[self.cache.rows(s.paged, 0, s.length)] = True
        self.guard_mask = ~owned
        self.guard_rows = (~owned).nonzero()[:, 0].to(dev)
        self.canary_k = torch.full((len(self.guard_rows), *shape), CANARY_K, dtype=self.cache.dtype, device=dev)
        self.canary_v = torch.full_like(self.canary_k, CANARY_V)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.reset()

    # -- the store --------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache.k[0].fill_(CANARY_K)
        self.cache.v[0].fill_(CANARY_V)

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[0].clone(), self.cache.v[0].clone()

    def guards_ok(self) -> bool:
        k, v = self.cache.k[0][self.guard_rows], self.cache.v[0][self.guard_rows]
        return same_bits(k, self.canary_k) and same_bits(v, self.canary_v)

    def placement(self, s: Stream, kind: str) -> Placement:
        return s.lane if kind == "lane" else s.paged

    def rounds(self) -> list[list[tuple[Stream, int, int]]]:
        """The writes of a short life: a prompt chunk, a middle chunk, then three one-row decode steps,
        each round writing every stream's next rows in one call."""
        segments = []
        for s in self.streams:
            a = max(1, math.ceil(0.6 * s.length))
            b = max(a, s.length - 3)
            segments.append([(0, a), (a, b - a), (b, 1), (b + 1, 1), (b + 2, 1)])
        return [[(s, start, count) for s, seg in zip(self.streams, segments)
                 for start, count in [seg[r]] if count > 0 and start < s.length] for r in range(5)]

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        dev = self.backend.device
        self.cache.write(0, rows.to(dev), k.to(dev), v.to(dev))

    def write_round(self, kind: str, segs: list[tuple[Stream, int, int]]) -> torch.Tensor:
        rows = torch.cat([self.cache.rows(self.placement(s, kind), a, n) for s, a, n in segs])
        self.write(rows, torch.cat([s.k[a:a + n] for s, a, n in segs]), torch.cat([s.v[a:a + n] for s, a, n in segs]))
        return rows

    def check_stores(self) -> list[Case]:
        rounds = self.rounds()
        finals, keep_ok, guards_ok = [], True, True
        for _ in range(self.cfg.repeats):
            self.reset()
            written = torch.zeros(self.cache.rows_total, dtype=torch.bool)
            for kind in ("lane", "paged"):
                for segs in rounds:
                    before = self.snapshot()
                    target = torch.zeros_like(written)
                    target[self.write_round(kind, segs)] = True
                    changed = self.changed_rows(before)
                    guards_ok &= not bool((changed & self.guard_mask).any())
                    keep_ok &= self.kept(changed, target)
                    written |= target
            finals.append(self.snapshot())
        repeat_ok = all(same_bits(f[0], finals[0][0]) and same_bits(f[1], finals[0][1]) for f in finals)
        paged_eq, worst = True, 0.0
        limit = SATURATE.get(self.dtype)
        for s in self.streams:
            lane_rows = self.cache.rows(s.lane, 0, s.length)
            page_rows = self.cache.rows(s.paged, 0, s.length)
            for store, x in ((self.cache.k[0], s.k), (self.cache.v[0], s.v)):
                got = store[lane_rows.to(store.device)].cpu()
                paged_eq &= same_bits(got, store[page_rows.to(store.device)].cpu())
                want = (x.clamp(-limit, limit) if limit else x).double()
                err = (got.double() - want).abs() / (want.abs() + MIN_NORMAL[self.dtype])
                worst = max(worst, float(err.max()))
            if s.q is not None:
                s.stored = tuple(t[lane_rows.to(t.device)].cpu().double() for t in (self.cache.k[0], self.cache.v[0]))
        bound = STORE_ROUNDOFF[self.dtype]
        stores_ok = repeat_ok and paged_eq and guards_ok and worst <= bound
        notes = _notes(repeats=repeat_ok, paged=paged_eq, guards=guards_ok, bound=worst <= bound)
        return [Case("stores", "store", self.backend.name, self.dtype, stores_ok, worst, bound, notes),
                Case("keep", "store", self.backend.name, self.dtype, keep_ok and guards_ok and repeat_ok, None, None,
                     _notes(keep=keep_ok, guards=guards_ok, repeats=repeat_ok))]

    @staticmethod
    def kept(changed: torch.Tensor, target: torch.Tensor) -> bool:
        """Rows a write was not aimed at (earlier rows of any stream, and all others) are unchanged."""
        return not bool((changed & ~target).any())

    def changed_rows(self, before: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[rows_total] bool on the CPU: store rows whose K or V bits differ from `before`."""
        words = lambda t: t.reshape(t.shape[0], -1).view(torch.int32)  # noqa: E731
        now = (self.cache.k[0], self.cache.v[0])
        return torch.stack([(words(a) != words(b)).any(1) for a, b in zip(now, before)]).any(0).cpu()

    # -- attention --------------------------------------------------------------------------------------
    def attended(self) -> list[Stream]:
        return [s for s in self.streams if s.q is not None]

    def decode_items(self) -> list[tuple[Stream, int]]:
        """Positions at the tile and split edges, and each stream's last."""
        marks = (0, KEY_TILE - 1, KEY_TILE, SPLIT_ROWS - 1, SPLIT_ROWS)
        return [(s, p) for s in self.attended() for p in sorted({m for m in marks if m < s.length} | {s.length - 1})]

    def chunk_spans(self) -> list[tuple[Stream, int, int]]:
        """Per stream, a chunk of chunk_rows rows across its last split (or tile) edge: causal inside it."""
        spans = []
        r = self.cfg.chunk_rows
        for s in self.attended():
            edge = SPLIT_ROWS if s.length > SPLIT_ROWS else KEY_TILE if s.length > KEY_TILE else 0
            start = max(0, min(edge - r // 2, s.length - r))
            spans.append((s, start, min(r, s.length - start)))
        return spans

    def decode_group(self, items, kind: str, q_row0: int = 0, extra: int = 0,
                     override: Placement | None = None) -> tuple[torch.Tensor, DecodeGroup]:
        lengths = [p + 1 + extra for _, p in items]
        lpad = tile_count(max(lengths)) * KEY_TILE
        table = torch.zeros(len(items), lpad, dtype=torch.long)  # padding points at row 0, a guard
        for i, ((s, _), n) in enumerate(zip(items, lengths)):
            rows = self.cache.key_rows(override or self.placement(s, kind), n)
            table[i, :len(rows)] = rows
        q = torch.stack([s.q[p] for s, p in items])
        return q, DecodeGroup(torch.arange(q_row0, q_row0 + len(items)), table, torch.tensor(lengths))

    def run(self, q: torch.Tensor, batch: AttentionBatch, m: Measure | None = None) -> torch.Tensor:
        dev = self.backend.device
        out = self.backend.attend(q.to(dev), self.cache.k[0], self.cache.v[0], batch, self.scale).cpu()
        if m is not None:
            m.guards_ok &= self.guards_ok()
        return out

    def measure(self, build: Callable[[str], tuple[torch.Tensor, AttentionBatch]]) -> Measure:
        m = Measure()
        for kind in ("lane", "paged"):
            q, batch = build(kind)
            getattr(m, kind).extend(self.run(q, batch, m) for _ in range(self.cfg.repeats))
        return m

    def errors(self, rows: list[tuple[Stream, int]], out: torch.Tensor, partial: bool) -> tuple[float, float]:
        """(error, bound) of the row/head with the largest error-to-bound ratio."""
        g = self.cfg.heads // self.cfg.kv_heads
        worst = (-1.0, 0.0, 1.0)
        for (s, p), o in zip(rows, out):
            k, v = s.stored[0][:p + 1], s.stored[1][:p + 1]
            q = s.q[p].double().view(self.cfg.kv_heads, g, -1)
            err = (o.double() - reference(q, k, v, self.scale)).abs().amax(-1)
            bound = attention_bound(q, k, v, self.scale, partial)
            i = int((err / bound).argmax())
            if float(err[i] / bound[i]) > worst[0]:
                worst = (float(err[i] / bound[i]), float(err[i]), float(bound[i]))
        return worst[1], worst[2]

    def check_queries(self, kernel: str) -> tuple[Case, Measure]:
        partial = kernel == "partial"
        items = self.decode_items()

        def build(kind):
            q, d = self.decode_group(items, kind)
            return q, AttentionBatch(d, [], partial)

        m = self.measure(build)
        worst, bound = self.errors(items, m.lane[0], partial)
        flags = dict(repeats=_same(m.lane) and _same(m.paged), paged=same_bits(m.lane[0], m.paged[0]),
                     guards=m.guards_ok, bound=worst <= bound)
        return Case("queries", kernel, self.backend.name, self.dtype, all(flags.values()), worst, bound,
                    _notes(**flags)), m

    def check_rows(self, kernel: str, queries: Measure) -> Case:
        partial = kernel == "partial"
        spans = self.chunk_spans()
        items = [(s, s.length - 1) for s in self.attended()]  # a decode group beside the chunks, as in a forward

        def build(kind):
            qd, d = self.decode_group(items, kind)
            chunks, qs, at = [], [qd], len(items)
            for s, a, n in spans:
                chunks.append(Chunk(at, n, a, self.cache.key_rows(self.placement(s, kind), a + n)))
                qs.append(s.q[a:a + n])
                at += n
            return torch.cat(qs), AttentionBatch(d, chunks, partial)

        m = self.measure(build)
        out = m.lane[0]
        chunk_rows = [(s, a + i) for s, a, n in spans for i in range(n)]
        chunk_out = out[len(items):]
        worst, bound = self.errors(chunk_rows, chunk_out, partial)
        # a chunk row equals the one-row decode at its position; the decode rows equal the decode-only batch
        decoded = {(id(s), p): o for (s, p), o in zip(self.decode_items(), queries.lane[0])}
        shared = [(o, decoded[(id(s), p)]) for (s, p), o in zip(items + chunk_rows, out)
                  if (id(s), p) in decoded]
        as_decode = all(same_bits(a, b) for a, b in shared)
        flags = dict(repeats=_same(m.lane) and _same(m.paged), paged=same_bits(m.lane[0], m.paged[0]),
                     guards=m.guards_ok, bound=worst <= bound, decode=as_decode)
        return Case("rows", kernel, self.backend.name, self.dtype, all(flags.values()), worst, bound,
                    _notes(**flags))

    # -- controls ---------------------------------------------------------------------------------------
    def controls(self, queries: dict[str, Measure]) -> list[Case]:
        name, dtype = self.backend.name, self.dtype
        kernel = "rows" if "rows" in queries else next(iter(queries))
        partial = kernel == "partial"
        longest = max(self.attended(), key=lambda s: s.length)
        last = [(longest, longest.length - 1)]
        cases = []

        # a page table with its first and last entries swapped: the paged read must differ from the lane's
        swapped = Placement(longest.paged.block_rows, list(longest.paged.blocks), True, list(longest.paged.pages))
        swapped.blocks[0], swapped.blocks[-1] = swapped.blocks[-1], swapped.blocks[0]
        q, d = self.decode_group(last, "paged", override=swapped)
        bad = self.run(q, AttentionBatch(d, [], partial))
        q, d = self.decode_group(last, "lane")
        good = self.run(q, AttentionBatch(d, [], partial))
        cases.append(Case("control: pages swapped", kernel, name, dtype, not same_bits(bad, good),
                          control=True, note="must fail: paged == contiguous"))

        # a length off by one: the extra key (a canary) must break the float64 bound
        q, d = self.decode_group(last, "lane", extra=1)
        worst, bound = self.errors(last, self.run(q, AttentionBatch(d, [], partial)), partial)
        cases.append(Case("control: length + 1", kernel, name, dtype, worst > bound, worst, bound,
                          control=True, note="must fail: float64 bound"))

        # a store meant for one stream's page landing in a neighbour's: the keep check must see it
        first = self.attended()[0]
        before = self.snapshot()
        target = torch.zeros(self.cache.rows_total, dtype=torch.bool)
        target[self.cache.rows(first.paged, 0, 1)] = True
        self.write(self.cache.rows(longest.paged, 0, 1), first.k[:1] + 1, first.v[:1] + 1)
        cases.append(Case("control: neighbour's page", "store", name, dtype,
                          not self.kept(self.changed_rows(before), target), control=True, note="must fail: keep"))
        self.restore(before)

        # a store one row past a lane's end: the guard canaries must see it
        before = self.snapshot()
        self.write(torch.tensor([first.lane.blocks[0] + self.cache.pages.window]), first.k[:1], first.v[:1])
        cases.append(Case("control: past a lane", "store", name, dtype, not self.guards_ok(), control=True,
                          note="must fail: guards"))
        self.restore(before)

        if "rows" in queries and "partial" in queries:
            same = same_bits(queries["partial"].lane[0], queries["rows"].lane[0])
            cases.append(Case("control: partial as rows", "partial", name, dtype, not same,
                              control=True, note="must fail: bits == rows"))
        return cases

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.cache.k[0].copy_(snap[0])
        self.cache.v[0].copy_(snap[1])


def _same(outs: list[torch.Tensor]) -> bool:
    return all(same_bits(o, outs[0]) for o in outs)


def _notes(**flags: bool) -> str:
    words = {"repeats": "repeats differ", "paged": "paged != contiguous", "guards": "canary changed",
             "bound": "over the bound", "keep": "earlier rows changed", "decode": "chunk row != decode row"}
    return "; ".join(words[k] for k, ok in flags.items() if not ok)
