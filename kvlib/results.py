"""The project's measured results: one versioned JSON file, shipped with the package.

Every benchmark writes what it measured to ``kvlib/results.json`` with :func:`record_run`; the
planner (:mod:`kvlib.plan.planner`), notebook 09 and the CLI read it with :func:`load_results`. Because
it is package data, it works the same after ``pip install`` and on Colab as in a checkout.
``benchmarks/RESULTS.md`` keeps the prose and the tables for people; nothing parses it (a test
checks that every figure its tables quote is in the JSON).

Layout (schema version :data:`SCHEMA_VERSION`)::

    {"schema_version": 1,
     "runs": {"cache": {"source": "benchmarks/bench_cache.py", "command": "...",
                        "date": "2026-12-03", "machine": "...", "model": "SmolLM2-135M",
                        "settings": {...},
                        "rows": {"kvlib-int4": {"perplexity_delta_pct": 0.247, ...}, ...},
                        ...},
              "pca": {...}, "paged": {...}, "quant": {...}, ...}}

A run holds one command's output, on one model (its ``model``). A run measured on another model
than the default (SmolLM2-135M) carries the model's offline name after a slash:
``"cache/gemma-3-270m"`` (:func:`run_name`; :func:`model_runs` gathers a run's models).

A run holds one command's output. Its ``rows`` (and any other groups of rows) map a row name to
its figures; cache rows are keyed by :mod:`kvlib.caches.registry` names, so one name goes from the
benchmark to the notebook and the CLI.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from kvlib.keys import BestKey, RowKey
from kvlib.specs import ModelSpec, get_spec

__all__ = [
    "best",
    "rows",
    "REFERENCE_CACHES",
    "RESULTS_ENV",
    "RUN_FIELDS",
    "SCHEMA_VERSION",
    "cache_cost",
    "cache_costs",
    "key_means",
    "load_results",
    "citation",
    "device",
    "build_distance",
    "closest_model",
    "for_model",
    "model_runs",
    "provenance",
    "reference",
    "record_run",
    "results_path",
    "run",
    "run_name",
]

#: Version of the file's layout; :func:`load_results` refuses any other.
SCHEMA_VERSION = 1

#: Environment variable naming a results file to read instead of the package's own.
RESULTS_ENV = "KVLIB_RESULTS"

#: Fields every run must carry: where the numbers come from.
RUN_FIELDS: tuple[str, ...] = ("source", "command", "date", "machine")

#: Figures :func:`cache_cost` returns, when the run holds them.
_COST_FIELDS = (
    "perplexity",
    "perplexity_delta_pct",
    "perplexity_delta_pct_mean",
    "x_smaller_than_fp16",
    "x_smaller_than_fp16_at_4096",
)


def results_path() -> Path:
    """The package's own results file (``kvlib/results.json``)."""
    return Path(str(resources.files("kvlib").joinpath("results.json")))


def _validate(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise ValueError(f"{where} must be a JSON object with a 'runs' mapping")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{where} has schema_version {version!r}; this kvlib reads {SCHEMA_VERSION}"
        )
    for name, entry in data["runs"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: run {name!r} must be an object")
        missing = [f for f in RUN_FIELDS if not isinstance(entry.get(f), str)]
        if missing:
            raise ValueError(f"{where}: run {name!r} lacks {', '.join(missing)}")
    return data


def load_results(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The measured results: from ``path``, else ``$KVLIB_RESULTS``, else the package's file.

    Raises:
        ValueError: the file does not exist, is not JSON, or is not schema
            :data:`SCHEMA_VERSION` with the provenance fields (:data:`RUN_FIELDS`) on every run.
    """
    if path is None and os.environ.get(RESULTS_ENV):
        path = os.environ[RESULTS_ENV]
    file = results_path() if path is None else Path(path)
    if not file.is_file():
        raise ValueError(f"results file {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"results file {file.name} is not valid JSON: {exc}") from exc
    return _validate(data, f"results file {file.name}")


def _results(results: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return load_results() if results is None else results


def run(name: str, results: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """One run by name (``"cache"``, ``"pca"``, ``"paged"``, ``"quant"``, …); ``{}`` if absent."""
    if not isinstance(name, str):
        raise TypeError(f"run name must be a str (got {type(name).__name__})")
    runs = _results(results).get("runs", {})
    entry = runs.get(name, {}) if isinstance(runs, Mapping) else {}
    return entry if isinstance(entry, Mapping) else {}


#: The offline model (:data:`kvlib.models.OFFLINE_MODELS`) a run without a model suffix was
#: measured on: every run before the second model was.
DEFAULT_MODEL = "smollm2-135m"


def run_name(base: str, model: str | None = None) -> str:
    """The name of run ``base`` (``"cache"``) measured on offline model ``model``: ``base`` for
    the default model (``None`` or :data:`DEFAULT_MODEL`), ``"<base>/<model>"`` otherwise.

    Raises:
        TypeError: a name that is not a string.
        ValueError: an empty name, or one holding a slash.
    """
    for label, value in (("run name", base), ("model", model)):
        if value is None and label == "model":
            continue
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a str (got {type(value).__name__})")
        if not value or "/" in value:
            raise ValueError(f"{label} must be non-empty and hold no '/' (got {value!r})")
    return base if model in (None, DEFAULT_MODEL) else f"{base}/{model}"


def model_runs(base: str, results: Mapping[str, Any] | None = None) -> dict[str, Mapping[str, Any]]:
    """Run ``base`` on every model it was measured on: ``{offline model name: run}``, the
    default model first (see :func:`run_name`); ``{}`` where none was."""
    runs = _results(results).get("runs", {})
    found: dict[str, Mapping[str, Any]] = {}
    if isinstance(runs.get(base), Mapping):
        found[DEFAULT_MODEL] = runs[base]
    for name, entry in runs.items():
        if name.startswith(f"{base}/") and isinstance(entry, Mapping):
            found[name.split("/", 1)[1]] = entry
    return found


#: How much a difference in the share of sliding-window layers weighs in :func:`build_distance`
#: against a factor of two in head width or in KV heads: the windows change what a quantized
#: cache saves (kvlib's int4: 3.1x smaller than fp16 on SmolLM2 at 4,096 tokens, 1.7x on
#: Gemma 3 270M, whose windows stay float16), so the sliding layers come first.
SLIDING_WEIGHT = 4.0


def build_distance(a: ModelSpec, b: ModelSpec) -> float:
    """How far apart two models' builds are, for the KV cache: ``SLIDING_WEIGHT`` × the
    difference in the share of sliding-window layers, plus ``|log2|`` of the ratio of head
    widths and of KV heads. 0 for the same build; symmetric. A latent (MLA) cache has no heads
    to compare: it is as far as the sliding term and its own ``head_dim`` make it."""
    for x in (a, b):
        if not isinstance(x, ModelSpec):
            raise TypeError(f"build_distance compares ModelSpecs (got {type(x).__name__})")

    def share(s: ModelSpec) -> float:
        return s.num_sliding_layers / s.num_layers

    d = SLIDING_WEIGHT * abs(share(a) - share(b))
    d += abs(math.log2(max(a.head_dim, 1) / max(b.head_dim, 1)))
    if not (a.is_mla or b.is_mla):
        d += abs(math.log2(a.num_kv_heads / b.num_kv_heads))
    return d


def closest_model(
    spec: ModelSpec, base: str, results: Mapping[str, Any] | None = None
) -> str | None:
    """Of the models run ``base`` was measured on (:func:`model_runs`), the one whose build is
    closest to ``spec``'s (:func:`build_distance`; ties go to the default model); ``None`` where
    the run is absent. A measured model the spec registry does not know counts as farthest."""
    runs = model_runs(base, results)
    if not runs:
        return None

    def distance(name: str) -> float:
        try:
            return build_distance(spec, get_spec(name))
        except ValueError:
            return math.inf

    return min(runs, key=distance)


def for_model(spec: ModelSpec, results: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``results`` as a plan for ``spec`` cites them: every run measured on several models
    (``"cache"`` and ``"cache/gemma-3-270m"``) read from the model closest in build
    (:func:`closest_model`), so that :func:`run` and :func:`cache_cost` give that model's
    figures, each naming its model (:func:`citation`). ``"measured_on"`` maps each such run to
    the model chosen (absent where every run has one model). The input is not changed."""
    data = _results(results)
    runs = data.get("runs", {})
    if not isinstance(runs, Mapping):
        return dict(data)
    bases = {name.split("/", 1)[0] for name in runs if "/" in name}
    if not bases:
        return dict(data)
    view = {**data, "runs": dict(runs), "measured_on": {}}
    for base in sorted(bases):
        chosen = closest_model(spec, base, data)
        if chosen is not None:
            view["runs"][base] = runs[run_name(base, chosen)]
            view["measured_on"][base] = chosen
    return view


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def cache_cost(
    name: str, results: Mapping[str, Any] | None = None
) -> dict[str, float | list[float]]:
    """The measured figures of one cache (a :mod:`kvlib.caches.registry` name) from the cache
    benchmark: ``perplexity``, ``perplexity_delta_pct`` (vs the reference DynamicCache on the
    protocol segment), ``perplexity_delta_pct_mean`` (over segments, where measured),
    ``x_smaller_than_fp16`` (fp16 bytes / the cache's bytes on the evaluated text) and
    ``x_smaller_than_fp16_at_4096``, and ``perplexity_delta_pct_segments`` (the per-segment
    deltas, a list). Only what was measured: ``{}`` for a cache the run does
    not hold. (Row names are registry names, checked by the tests; this module does not import
    the registry, so that ``kvlib plan`` stays free of torch and transformers.)

    Raises:
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"cache name must be a str (got {type(name).__name__})")
    rows = run("cache", results).get("rows", {})
    entry = rows.get(name) if isinstance(rows, Mapping) else None
    if not isinstance(entry, Mapping):
        return {}
    out: dict[str, float | list[float]] = {}
    for field in _COST_FIELDS:
        value = _number(entry.get(field))
        if value is not None:
            out[field] = value
    segments = entry.get("perplexity_delta_pct_segments")
    if isinstance(segments, list):
        values = [_number(x) for x in segments]
        if values and all(v is not None for v in values):
            out["perplexity_delta_pct_segments"] = [float(v) for v in values if v is not None]
    return out


def cache_costs(
    results: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, float | list[float]]]:
    """:func:`cache_cost` of every cache the cache benchmark measured, in its order."""
    results = _results(results)
    rows = run("cache", results).get("rows", {})
    return {name: cache_cost(name, results) for name in rows} if isinstance(rows, Mapping) else {}


def provenance(entry: Mapping[str, Any]) -> str:
    """``"on <model>, measured <date> by <source>"`` for a run (without ``on …`` when the run
    names no model, e.g. kernels timed on a tensor)."""
    where = f"on {entry['model']}, " if entry.get("model") else ""
    return f"{where}measured {entry.get('date', '?')} by {entry.get('source', '?')}"


#: The engine that ran each benchmark, for runs that do not name one (``entry["engine"]``).
_ENGINES_BY_SOURCE: dict[str, str] = {
    "benchmarks/bench_cache.py": "transformers",
    "benchmarks/bench_pca.py": "transformers",
    "benchmarks/bench_eviction.py": "transformers",
    "benchmarks/bench_keys.py": "transformers",
    "benchmarks/bench_kvpress.py": "transformers + kvpress",
    "benchmarks/bench_engines.py": "llama.cpp",
    "benchmarks/bench_vllm.py": "vLLM",
    "benchmarks/bench_kernel.py": "kvlib's Triton kernel and torch SDPA",
    "benchmarks/bench_turboquant.py": "transformers",
    "benchmarks/bench_paged.py": "kvlib's reference PagedAttention",
    "benchmarks/bench_quant.py": "kvlib's, quanto's and HQQ's quantizers in torch",
}


def _device(machine: str) -> str:
    """A run's device in a few words, from its ``machine`` field: ``"a CPU (Intel Xeon)"``,
    ``"a GPU (NVIDIA H200)"``."""
    first = machine.split(";")[0].split(",")[0].strip()
    cpu = "no GPU" in machine or "CPU" in machine or "thread" in machine
    if not cpu and ("GPU" in machine or "NVIDIA" in machine):
        return f"a GPU ({first})"
    return f"a CPU ({first})" if first and first != "x86_64" else "a CPU"


def device(entry: Mapping[str, Any]) -> str:
    """The device a run was measured on, in a few words (``"a CPU (AMD EPYC)"``, ``"a GPU
    (NVIDIA H200)"``), read from its ``machine`` field; ``"an unnamed machine"`` without one."""
    machine = entry.get("machine")
    return _device(machine) if isinstance(machine, str) and machine else "an unnamed machine"


def citation(entry: Mapping[str, Any]) -> str:
    """What a cited figure was measured on: ``"on SmolLM2-135M with llama.cpp on a CPU (Intel
    Xeon), measured 2026-12-03 by benchmarks/bench_engines.py"``: the model, the engine (the
    run's ``engine``, else the benchmark's, :data:`_ENGINES_BY_SOURCE`) and the device (read
    from ``machine``), so that a plan never quotes a figure without them. Parts a run does not
    say are left out."""
    source = str(entry.get("source", "?"))
    engine = entry.get("engine") or _ENGINES_BY_SOURCE.get(source)
    machine = entry.get("machine")
    parts = [f"on {entry['model']}"] if entry.get("model") else []
    if engine:
        parts.append(f"with {engine}")
    if isinstance(machine, str) and machine:
        parts.append(f"on {_device(machine)}")
    parts.append(f"measured {entry.get('date', '?')} by {source}")
    return (" ".join(parts[:-1]) + ", " if len(parts) > 1 else "") + parts[-1]


def record_run(
    name: str,
    entry: Mapping[str, Any],
    path: str | os.PathLike[str] | None = None,
) -> Path:
    """Write one run into a results file (default: the package's), replacing the run of that
    name and keeping the others. ``date`` defaults to today (UTC).

    Args:
        name: the run's name (``"cache"``, ``"pca"``, …).
        entry: the run: :data:`RUN_FIELDS` plus its settings and rows (JSON-serialisable).
        path: the file to update; created with an empty ``runs`` mapping if absent.

    Returns:
        The path written.

    Raises:
        ValueError: a provenance field is missing or a value is not JSON-serialisable
            (NaN and infinities are written as ``null``).
    """
    file = results_path() if path is None else Path(path)
    if file.is_file():
        data = _validate(json.loads(file.read_text(encoding="utf-8")), str(file))
    else:
        data = {"schema_version": SCHEMA_VERSION, "runs": {}}
    entry = {"date": datetime.datetime.now(datetime.UTC).date().isoformat(), **entry}
    _validate({"schema_version": SCHEMA_VERSION, "runs": {name: entry}}, "the new run")
    data["runs"][name] = _finite(entry)
    try:
        text = json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"run {name!r} is not JSON-serialisable: {exc}") from exc
    file.write_text(text + "\n", encoding="utf-8")
    return file


def _finite(x: Any) -> Any:
    """``x`` with NaN and infinities replaced by ``None`` (JSON ``null``: not measured)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# -- rows by key: the readers' view of a run (keys parsed by kvlib.keys alone) --------------------

#: The uncompressed reference caches (:func:`kvlib.caches.registry.reference_name`), one per
#: dtype a model computes in; a run's reference row is the one of these it holds.
REFERENCE_CACHES: tuple[str, ...] = ("dynamic-fp32", "dynamic-fp16", "dynamic-bf16")


def reference(entry: Mapping[str, Any], group: str = "rows") -> RowKey:
    """The key of the run's uncompressed reference row (one of :data:`REFERENCE_CACHES`).

    Raises:
        ValueError: the run holds no reference row, or more than one.
    """
    found = [k for k in rows(entry, group) if k.budget is None and k.cache in REFERENCE_CACHES]
    if len(found) != 1:
        raise ValueError(
            f"expected one reference row ({', '.join(REFERENCE_CACHES)}) in {group!r}, "
            f"found {[str(k) for k in found]}"
        )
    return found[0]


def key_means(entry: Mapping[str, Any]) -> dict[str, float]:
    """Means over segments of a ``benchmarks/bench_keys.py`` run's key measurements:
    ``"channel spread"`` and, per recipe (``"per-token"``, ``"per-token, rotated"``,
    ``"per-channel"``), its attention-output error.

    Raises:
        ValueError: the run has no key measurements.
    """
    keys = entry.get("keys") if isinstance(entry, Mapping) else None
    if not isinstance(keys, Mapping) or "channel_spread_segments" not in keys:
        raise ValueError("not a benchmarks/bench_keys.py run (no key measurements)")
    prefix = "attention_error_segments "
    out = {"channel spread": keys["channel_spread_segments"]}
    out |= {name[len(prefix) :]: v for name, v in keys.items() if name.startswith(prefix)}
    return {name: sum(v) / len(v) for name, v in out.items()}


def rows(entry: Mapping[str, Any], group: str = "rows") -> dict[RowKey, Mapping[str, Any]]:
    """A run's rows (or another group of them) by :class:`RowKey`, in the run's order.

    Raises:
        ValueError: the run has no such group, or two of its names parse to one key.
    """
    table = entry.get(group)
    if not isinstance(table, Mapping):
        raise ValueError(f"the run has no group of rows {group!r} (it has {sorted(entry)})")
    keyed: dict[RowKey, Mapping[str, Any]] = {}
    for name, row in table.items():
        key = RowKey.parse(name)
        if key in keyed:
            raise ValueError(f"rows {str(key)!r} and {name!r} parse to the same key")
        keyed[key] = row
    return keyed


def best(entry: Mapping[str, Any]) -> dict[BestKey, RowKey]:
    """A run's ``best`` group: for each (budget, family), the key of the best row.

    Raises:
        ValueError: the run has no ``best`` group, or it names a row the run does not hold.
    """
    table = entry.get("best")
    if not isinstance(table, Mapping):
        raise ValueError("the run has no 'best' group")
    held = rows(entry)
    out: dict[BestKey, RowKey] = {}
    for name, row_name in table.items():
        key = RowKey.parse(row_name)
        if key not in held:
            raise ValueError(f"best row {row_name!r} (for {name!r}) is not among the run's rows")
        out[BestKey.parse(name)] = key
    return out
