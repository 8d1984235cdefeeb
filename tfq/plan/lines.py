"""The plan in words: one fact a line (`tfq plan`, and every command's opening), and the same facts as JSON."""
from __future__ import annotations

import dataclasses

from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS
from tfq.model.config import ModelConfig
from tfq.parallel.shard import Shard, gathered_floats, sizes
from tfq.plan.fields import DTYPE_BYTES, parse_draft
from tfq.plan.layout import Layout, budget_words, prefix_snapshots
from tfq.plan.schema import Plan
from tfq.plan.words import human_bytes, one_line, tag


def _streams(first: int, last: int) -> str:
    return f"stream {first}" if first == last else f"streams {first}-{last}"


def plan_lines(plan: Plan, config: ModelConfig, layout: Layout) -> list[str]:
    """One fact a line, in words a person reads without the docs."""
    lay, t = layout, lambda *keys: tag(plan, *keys)
    dtype = plan.kv.dtype
    kinds = (f" ({len(config.deltanet_layers)} Gated DeltaNet + {len(config.attention_layers)} gated attention, "
             f"rotary on {config.rotary_dim} of {config.head_dim} dims)" if config.hybrid else "")
    lines = [
        f"model: {plan.model}{t('model')}: {config.family}, {config.num_layers} layers{kinds}, {config.num_heads} "
        f"query heads and {config.num_kv_heads} key-value heads, head dim {config.head_dim}",
        *([f"skipped: {config.skipped} of the checkpoint; tfq runs its text model"] if config.skipped else []),
        *_weights_lines(plan, config, lay),
        *_experts_lines(plan, config),
        f"window: {plan.window} rows a stream may hold, prompt and reply together{t('window')}",
        f"lanes: {plan.lanes} stream{'s' * (plan.lanes > 1)} in one forward at most{t('lanes')}",
        f"prefill: prompts go in chunks of {plan.prefill_chunk} rows{t('prefill_chunk')}",
        f"step: while any stream decodes, {_step_bound(lay)}{t('step_tokens')}: every lane's decode first, then "
        f"prompt chunks in what is left, so a prompt holds back another stream's next token by one such step at most",
        f"logits: at most {lay.logits_rows} rows a forward, {human_bytes(lay.logits_bytes)} in fp32{t('logits_rows')}: "
        f"every lane's drawing rows, and the prompt rows of streams that score their prompts, in chunks within it",
        f"cached row: {human_bytes(lay.row_bytes)} a row in {dtype}{t('kv.dtype')} ({len(config.attention_layers)} "
        f"{'attention ' * config.hybrid}layers x key and value x {config.num_kv_heads} heads x {config.head_dim} dims "
        f"x {DTYPE_BYTES[dtype]} bytes), on the CPU resident once written: the sizes below are full windows'",
        *_state_lines(plan, config, lay),
    ]
    one_window = plan.window * lay.row_bytes
    pages, page_tag = lay.page_rows, t("kv.pages")
    if pages == 0:
        lines.append(f"stream 0: contiguous, {plan.window} rows, {human_bytes(one_window)}")
        if plan.lanes > 1:
            each = f"{plan.window} rows each, {human_bytes((plan.lanes - 1) * one_window)} together"
            if plan.lanes == 2:
                each = f"{plan.window} rows, {human_bytes(one_window)}"
            lines.append(f"{_streams(1, plan.lanes - 1)}: contiguous too, {each}")
        lines.append(f"0 more taking pages: pages are off (kv.pages: 0){page_tag}")
        if plan.kv.pool != "auto":
            lines.append(f"pool: none; kv.pool {plan.kv.pool}{t('kv.pool')} is unused while pages are off")
    else:
        if lay.contiguous_lanes:
            lines.append(f"stream 0: contiguous, {plan.window} rows, {human_bytes(one_window)}{t('kv.paged')}")
        else:
            lines.append(f"stream 0: paged, on {pages}-row pages{page_tag} like every stream{t('kv.paged')}")
        more = plan.lanes - 1
        if lay.paged_lanes == 0:
            lines.append(f"0 more taking pages: lanes is {plan.lanes}{t('lanes')}, so stream 0 runs alone")
        else:
            lines.append(
                f"{more} more taking pages: {pages}-row pages{page_tag}, {human_bytes(pages * lay.row_bytes)} "
                f"a page, {lay.pages_per_stream} pages for a full window"
            )
        lines.append(_pool_line(plan, lay))
    if plan.kv.prefix_cache == "on" or "kv.prefix_cache" in dict(plan.sources):
        lines.append(_prefix_line(plan, lay))
    if plan.attention == "rows":
        lines.append(
            f"attention: rows{t('attention')}: one pass over a stream's keys in {KEY_TILE}-row tiles, "
            f"online softmax in fp32"
        )
    else:
        lines.append(
            f"attention: partial{t('attention')}: keys in {SPLIT_ROWS}-row splits of {KEY_TILE}-row tiles, "
            f"merged in order by log-sum-exp in fp32 (exact against itself, other bits than rows)"
        )
    lines.append(_device_line(plan, lay, config))
    if plan.tp > 1 or plan.source("tp"):
        lines += tp_lines(plan, config, lay)
    kind, k = parse_draft(plan.draft)
    if kind == "none":
        lines.append(f"drafting: none{t('draft')}")
    elif kind == "ngram":
        steps = f", up to {k} tokens a step" if k else ""
        lines.append(f"drafting: n-gram lookup in the stream's own text{steps}{t('draft')}")
    else:
        lines.append(f"drafting: draft checkpoint {plan.draft}{t('draft')}")
    spare = lay.budget_bytes - lay.total_bytes
    verdict = f"fits, {human_bytes(spare)} to spare" if lay.fits else f"does not fit, over by {human_bytes(-spare)}"
    lines.append(f"activations: {human_bytes(lay.activation_bytes)} at most, the largest forward's {lay.forward_rows} "
                 f"rows ({plan.lanes} lane{'s' * (plan.lanes > 1)} x a {plan.prefill_chunk}-row prompt chunk) in fp32")
    lines.append(
        f"total: {human_bytes(lay.total_bytes)} (weights {human_bytes(lay.weights_bytes)} + cache "
        f"{human_bytes(lay.cache_bytes)} + logits {human_bytes(lay.logits_bytes)} + activations "
        f"{human_bytes(lay.activation_bytes)}) of a {human_bytes(lay.budget_bytes)} budget{budget_words(plan, lay)}: "
        f"{verdict}"
    )
    lines.append(f"resident memory: the total and at most {human_bytes(lay.overhead_bytes)} more, fixed (torch, tfq's "
                 f"kernels, the tokenizer)")
    return [one_line(line) for line in lines]


def _state_lines(plan: Plan, config: ModelConfig, lay: Layout) -> list[str]:
    """A hybrid's DeltaNet state: what one stream keeps, all lanes, and the verify rows drafting keeps."""
    if not config.hybrid:
        return []
    n = config.deltanet
    one = config.state_bytes
    line = (f"state: {len(config.deltanet_layers)} DeltaNet layers x (recurrence {n.value_heads} x {n.key_dim} x "
            f"{n.value_dim} + convolution window {n.conv_kernel - 1} x {n.channels}) x 4 bytes (fp32) = "
            f"{human_bytes(one)} a stream, whatever its length; {plan.lanes} lane{'s' * (plan.lanes > 1)} take "
            f"{plan.lanes} state slot{'s' * (plan.lanes > 1)}")
    if lay.verify_rows:
        line += (f"; drafting keeps a second copy, from before each verify, and the inputs of its "
                 f"{lay.verify_rows} rows, to roll rejected guesses back by running the kept rows again")
    prefix = plan.kv.prefix_cache == "on" and lay.page_rows > 0
    if prefix:
        line += (f"; the prefix cache keeps {prefix_snapshots(plan.lanes)} more states, each where a stream's rows "
                 f"filled a page, least recently used replaced first")
    line += f": {human_bytes(lay.state_bytes)} in all (in the cache's total)"
    then = ("; a stream whose prompt starts with cached pages maps them up to the last one whose state is kept and "
            "starts its DeltaNet layers from that state" if prefix else "")
    return [line, f"preemption drops a stream's state and recomputes it from its first row{then}"]


def _device_line(plan: Plan, lay: Layout, config: ModelConfig) -> str:
    auto = ""
    if plan.device == "auto":
        auto = " (auto: a CUDA GPU is here)" if lay.device != "cpu" else " (auto: no CUDA GPU here)"
    if lay.device == "cpu":
        kernels = ("tfq's C++ kernels: linear layers and attention in fixed orders, each decoder layer one call "
                   "(built once for this CPU; TFQ_CPU_KERNELS=torch, or no compiler: oneDNN and bmm)")
        if config.hybrid:
            kernels = ("tfq's C++ kernels: linear layers, attention and the DeltaNet recurrence in fixed orders, "
                       "layer by layer (built once for this CPU; a hybrid needs them)")
        if config.moe is not None:  # tfq/model/moe.py: the experts through the same linear kernels
            kernels = kernels.replace("each decoder layer one call", "a mixture's layers op by op")
    else:
        import torch

        kernels = f"{torch.cuda.get_device_name(torch.device(lay.device))}, Triton kernels for linear layers, " \
                  f"norms, attention and cache stores"
    return f"device: {lay.device}{auto}{tag(plan, 'device')}: {kernels}"


def tp_lines(plan: Plan, config: ModelConfig, lay: Layout) -> list[str]:
    """Tensor parallelism: how the model splits, what a rank holds, what a step gathers."""
    n, t = plan.tp, tag(plan, "tp")
    if n == 1:
        return [f"tp: 1{t}: one process holds the whole model"]
    heads = sizes(config.num_kv_heads, n)
    shards = [Shard(config, r, n) for r in range(n)]
    weights = [4 * s.params() for s in shards]
    cache = [(lay.cache_bytes - lay.state_bytes) * k // config.num_kv_heads for k in heads]
    if config.hybrid:  # the states split by DeltaNet key heads
        keys = config.deltanet.key_heads
        cache = [c + lay.state_bytes * k // keys for c, k in zip(cache, sizes(keys, n))]
    per_row, per_logit = gathered_floats(config)
    token = 4 * (per_row + per_logit)
    idle = heads.count(0)
    spare = (f"; {idle} rank{'s hold' if idle > 1 else ' holds'} no attention head, "
             f"only {'their' if idle > 1 else 'its'} share of the rest" if idle else "")
    if config.hybrid:
        spare += f"; DeltaNet by whole key heads ({' + '.join(map(str, sizes(config.deltanet.key_heads, n)))})"
    return [
        f"tp: {n} ranks{t}: rank 0 is this process, tfq starts the others (gloo on the CPU, NCCL on GPUs); every "
        f"matrix split by its outputs and the attention by whole key-value heads ({' + '.join(map(str, heads))}"
        f"{spare}), so no sum is split and the bits are tp: 1's",
        f"a rank holds: weights {' / '.join(human_bytes(w) for w in weights)} (fp32; the embedding and the norms "
        f"whole on every rank), cache {' / '.join(human_bytes(c) for c in cache)}",
        f"gathered: {per_row} floats a row over the {config.num_layers} layers (each: the heads' outputs, o, SiLU * "
        f"up, down) and {per_logit} a logits row: "
        f"{human_bytes(token)} a decoded token, of which a rank receives all but its own columns",
    ]


def _pool_line(plan: Plan, lay: Layout) -> str:
    size = (
        f"pool: {lay.pool_pages} pages, {lay.pool_pages * lay.page_rows} rows, "
        f"{human_bytes(lay.pool_pages * lay.page_rows * lay.row_bytes)}{tag(plan, 'kv.pool')}"
    )
    if lay.paged_lanes == 0:
        return f"{size}; no stream takes pages"
    full, streams = lay.pool_full, f"{lay.paged_lanes} paged stream{'s' * (lay.paged_lanes > 1)}"
    if lay.pool_pages >= full:
        how = "auto: " if plan.kv.pool == "auto" else ""
        return f"{size} ({how}enough for {streams} at the full window)"
    how = "auto: what the budget leaves; " if plan.kv.pool == "auto" else ""
    return (
        f"{size} ({how}{streams} at the full window need {full}; when it runs out, "
        f"streams are preempted and recomputed later)"
    )


def _prefix_line(plan: Plan, lay: Layout) -> str:
    head = f"prefix cache: {plan.kv.prefix_cache}{tag(plan, 'kv.prefix_cache')}"
    if plan.kv.prefix_cache == "off":
        return f"{head}: every stream computes its whole prompt"
    if lay.page_rows == 0 or lay.paged_lanes == 0:
        return f"{head}, but no stream takes pages, and it keeps pages: nothing is reused (set kv.pages)"
    lane = "; stream 0's contiguous lane neither reads nor fills it" if lay.contiguous_lanes else ""
    disk = ""
    if plan.kv.prefix_store != "off":
        disk = (f"; every full page is also kept on disk in {plan.kv.prefix_store}{tag(plan, 'kv.prefix_store')} "
                f"(at most {human_bytes(plan.kv.prefix_store_size)}, least recently used files removed first), "
                f"where this model's later runs find it after a restart")
    return (f"{head}: a full {lay.page_rows}-row page is found again by the tokens up to its end; pages no stream "
            f"holds keep their rows until the pool needs them, so it may keep all {lay.pool_pages} pages, least "
            f"recently used evicted first{lane}{disk}")


def _step_bound(lay) -> str:
    if lay.step_steps:
        return (f"a step lasts at most {lay.step_steps} decode steps of the streams running, by what steps cost "
                f"here as the engine learns it (until then it holds at most {lay.step_tokens} rows)")
    return f"a forward holds at most {lay.step_tokens} rows"


def _weights_lines(plan: Plan, config: ModelConfig, lay: Layout) -> list[str]:
    """How the weights are kept and computed, and the bytes a decode step reads of them."""
    from tfq.model.footprint import activations_of, gguf_kept, weights_kind

    kind, why = weights_kind(plan.weights, plan.model, lay.device)
    said = f" ({why})" if plan.weights == "auto" else ""
    if kind == "fp32":
        stored = config.weights_dtype
        if config.quantized:  # an MLX checkpoint: dequantized at load, the bits MLX's own dequantization gives
            stored = f"{config.quantized} (dequantized at load exactly as MLX does, then widened to fp32)"
        return [f"weights: fp32{tag(plan, 'weights')}{said}: stored as {stored}, computed in fp32: "
                f"{config.param_count() / 1e6:.1f}M parameters, {human_bytes(lay.weights_bytes)}"]
    if kind == "mlx":
        return _mlx_lines(plan, config, lay, said)
    if kind == "gguf-q8":
        first = (f"weights: gguf-q8{tag(plan, 'weights')}{said}: the file's quantized blocks are kept and computed "
                 f"with; activations are rounded to 8 bits per block of 32 and summed in integers (llama.cpp's kind of "
                 f"arithmetic: exact alone or together, but not weights: fp32's bits; weights: gguf gives those)")
    else:
        first = (f"weights: gguf{tag(plan, 'weights')}{said}: the file's quantized blocks are kept and computed "
                 f"with; activations stay fp32 and each weight is unpacked exactly, so the bits are weights: fp32's")
    summary = gguf_kept(plan.model, activations_of(kind))
    kinds = " + ".join(f"{n} {k}" for k, n in sorted(summary.counts.items(), key=lambda kv: -kv[1]))
    return [first, f"weights kept: {human_bytes(summary.resident)} ({kinds} matrices packed for the kernel, the "
                   f"embedding's {human_bytes(summary.embedding)} left on the mapped file, its rows read as "
                   f"looked up); a decode step reads {human_bytes(summary.step)} of them (in fp32: "
                   f"{human_bytes(summary.fp32)})"]


def experts_read(config: ModelConfig, lanes: int) -> dict:
    """What a mixture's decode step reads of its experts at `lanes` rows: each chosen expert once for every row that
    chose it, so at one lane `chosen` experts a layer, at more the distinct experts the rows chose (expected, were
    the router's choices uniform); parameters of the whole step (attention, dense layers, router and head too)."""
    return {"lanes": lanes, "experts_a_layer": round(config.moe.expected_distinct(lanes), 1),
            "parameters": round(config.read_params(lanes))}


def _experts_lines(plan: Plan, config: ModelConfig) -> list[str]:
    """A mixture of experts: how many, and what a decode step reads of them at one lane and at the plan's lanes."""
    m = config.moe
    if m is None:
        return []
    one, many = experts_read(config, 1), experts_read(config, plan.lanes)
    at_lanes = "" if plan.lanes == 1 else (
        f"; at {plan.lanes} lanes about {many['experts_a_layer']:g} distinct experts a layer (were the router's "
        f"choices uniform), {many['parameters'] / 1e6:.1f}M parameters ({human_bytes(4 * many['parameters'])} in fp32)")
    return [f"experts: {m.experts} in each of {len(config.moe_layers)} layers, {m.chosen} chosen a row (weights "
            f"{'normalized to sum to 1' if m.normalized else 'as the softmax gives them'}), each expert read once a "
            f"step for all the rows that chose it: a decode step at 1 lane reads {one['parameters'] / 1e6:.1f}M of "
            f"the {config.param_count() / 1e6:.1f}M parameters ({human_bytes(4 * one['parameters'])} in fp32)"
            f"{at_lanes}"]


def _mlx_lines(plan: Plan, config: ModelConfig, lay: Layout, said: str) -> list[str]:
    """weights: mlx: the groups kept, and about what a decode step reads of them."""
    from pathlib import Path

    from tfq.kernels.quant import kept_bytes
    from tfq.model.mlx import folder_quantization

    quant = folder_quantization(Path(plan.model).expanduser())
    first = (f"weights: mlx{tag(plan, 'weights')}{said}: its groups are kept and computed with, each weight unpacked "
             f"as MLX dequantizes it (the product and the sum each rounded); activations stay fp32, so the bits "
             f"are weights: fp32's")
    if quant is None:
        return [first]
    matrices = config.param_count() - (0 if config.tie_embeddings else config.vocab_size * config.hidden_size)
    step = kept_bytes(quant.bits, quant.group_size, True, matrices, 1)
    return [first, f"weights kept: {human_bytes(lay.weights_bytes)}; a decode step reads about {human_bytes(step)} of "
                   f"them ({quant.bits}-bit codes, an fp32 scale and bias per {quant.group_size} weights; in fp32: "
                   f"{human_bytes(4 * matrices)})"]


def plan_json(plan: Plan, config: ModelConfig, layout: Layout) -> dict:
    """The same facts as plan_lines, as JSON-ready data."""
    values = {
        "model": plan.model, "weights": plan.weights, "window": plan.window, "lanes": plan.lanes,
        "prefill_chunk": plan.prefill_chunk, "logits_rows": plan.logits_rows, "step_tokens": plan.step_tokens,
        "kv": dataclasses.asdict(plan.kv), "attention": plan.attention, "budget": plan.budget,
        "draft": plan.draft, "device": plan.device, "tp": plan.tp,
    }
    model = {
        "family": config.family, "layers": config.num_layers, "query_heads": config.num_heads,
        "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "max_positions": config.max_positions,
        "weights_dtype": config.weights_dtype, "parameters": config.param_count(),
    }
    if config.moe is not None:
        model["experts"] = {"experts": config.moe.experts, "chosen": config.moe.chosen,
                            "layers": len(config.moe_layers), "normalized": config.moe.normalized,
                            "read_at_1_lane": experts_read(config, 1),
                            "read_at_lanes": experts_read(config, plan.lanes)}
    lay = dataclasses.asdict(layout)
    lay.update(fits=layout.fits, rows_total=layout.rows_total, pages_per_stream=layout.pages_per_stream,
               key_tile=KEY_TILE, split_rows=SPLIT_ROWS)
    return {
        "plan": values, "sources": dict(plan.sources), "model": model, "layout": lay,
        "lines": plan_lines(plan, config, layout),
    }
