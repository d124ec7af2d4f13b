#!/usr/bin/env bash
# One short GPU session for notebook 10 and notebook 08's GPU half, prepared on CPU.
#
#   OUT=build/gpu bash scripts/gpu_session.sh        # on a CUDA machine, from the repo root
#
# It uses the machine's own python, torch, triton and transformers (a lent GPU machine may
# have no network: nothing is downloaded) with kvlib from this tree (PYTHONPATH). nbval and its
# Jupyter stack, absent from such machines, come as wheels in .whl/ (ignored by git: carry it),
# fetched beforehand on a machine with PyPI:
#
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform linux_x86_64 \
#       -d .whl nbval==0.11.0 ipykernel==7.4.0 ipywidgets==8.1.8   # 44 wheels, 20 MB
#
# Each step runs under its own time limit, all of them within TOTAL_LIMIT, each logged to
# $OUT/NAME.log whatever the others do, and listed in $OUT/steps.txt:
#
#   1. install: nbval and ipykernel with the dependencies this python lacks (or has too old),
#      unpacked from .whl/ into $SITE (default /tmp/site), which goes on PYTHONPATH; a package
#      the machine already has in a fitting version is never shadowed (torch, numpy, ...);
#   2. environment: GPU name and capability, torch / triton / transformers / nbval versions;
#   3. notebook 10 under strict nbval on CUDA (its kernels compiled, its last section timing
#      the kernel against fp16 SDPA); the printed device name (cpu in the committed outputs)
#      is sanitized in a copy of notebooks/nbval_sanitize.cfg;
#   4. benchmarks/bench_kernel.py: decode-step latency 1k-128k, bytes read, bandwidth, the
#      whole-model decode at 32k (run "kernel", written to $OUT/results.json, a copy of
#      kvlib/results.json); every fused row is first checked against the torch path on CUDA
#      (float16), so a wrong kernel stops it;
#   5. scripts/gpu_check.py: notebook 08's full-model check on a random-initialised model,
#      with whatever time is left (its --time-limit leaves room for the section in progress).
# (tests/test_kernels.py is left out: the test suite runs the kernel in Triton's interpreter.)
#
# About 6 minutes on an H100/H200-class GPU (an estimate: not yet run on one), never more than
# TOTAL_LIMIT (default 450 s) plus a few seconds. $OUT holds 7 flat files: steps.txt, install.log, environment.log,
# nbval_09.log, bench_kernel.log, gpu_check.log, results.json.
# Exit status: the number of steps that failed (a step skipped for lack of time counts).
set -u
OUT=${OUT:-build/gpu}
PYTHON=${PYTHON:-python3}
TOTAL_LIMIT=${TOTAL_LIMIT:-450}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
T_END=$((SECONDS + TOTAL_LIMIT))
mkdir -p "$OUT"
: >"$OUT/steps.txt"
cp kvlib/results.json "$OUT/results.json"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1  # a step killed at its limit keeps its log
# nothing may wait on a network (there is none) or need a writable home directory
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kvlib-gpu/triton} MPLCONFIGDIR=/tmp/kvlib-gpu/mpl
export JUPYTER_RUNTIME_DIR=/tmp/kvlib-gpu/jupyter IPYTHONDIR=/tmp/kvlib-gpu/ipython
# ipywidgets travels with the wheels too: without it, tqdm (imported by transformers) writes
# "IProgress not found" to the first cell's stderr, which strict nbval compares (seen on the H200)
mkdir -p "$TRITON_CACHE_DIR" "$MPLCONFIGDIR" "$JUPYTER_RUNTIME_DIR" "$IPYTHONDIR"
failed=0

step() {  # step NAME LIMIT COMMAND...: run with a time limit, log to $OUT/NAME.log, count failures
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="install nbval_09"
    local left=$((T_END - SECONDS - 5))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped, ${TOTAL_LIMIT} s session limit reached" | tee -a "$OUT/steps.txt"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local why=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why=" (timed out)"; fi
    echo "$name: exit $rc$why in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

step install 60 env PYTHONPATH= "$PYTHON" - "$WHEELS" "$SITE" nbval ipykernel ipywidgets <<'EOF'
"""Unpack the wheels the roots need and this python lacks (or has in a version that does not
fit) into SITE. A wheel is a zip: its files go to SITE, .data/purelib|platlib merged in,
.data/scripts|data|headers left out (nothing here needs them)."""
import email.parser, glob, os, sys, zipfile
from importlib import metadata

wheel_dir, site, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # packaging is pure python: import it from its wheel
    sys.path.insert(0, glob.glob(os.path.join(wheel_dir, "packaging-*.whl"))[0])
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    del sys.path[0]  # so that packaging counts as missing, and is unpacked if needed

wheels = {}
for path in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))):
    name, version = os.path.basename(path).split("-")[:2]
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist")
    wheels[canonicalize_name(name)] = (path, version, requires or [])
print(f"python {sys.version.split()[0]} at {sys.executable}; {len(wheels)} wheels in {wheel_dir}")


def have(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


chosen, kept, problems = {}, {}, []
todo = [(Requirement(r), "root") for r in roots]
while todo:
    req, by = todo.pop()
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    key = canonicalize_name(req.name)
    if key in chosen:
        if not req.specifier.contains(chosen[key], prereleases=True):
            problems.append(f"{by} needs {req}, the wheel is {chosen[key]}")
        continue
    installed = kept.get(key) or have(req.name)
    if installed is not None and req.specifier.contains(installed, prereleases=True):
        kept[key] = installed
        continue
    if key not in wheels:
        problems.append(f"{by} needs {req}: installed {installed}, no wheel")
        continue
    path, version, requires = wheels[key]
    if not req.specifier.contains(version, prereleases=True):
        problems.append(f"{by} needs {req}: installed {installed}, wheel {version}")
    kept.pop(key, None)
    chosen[key] = version
    todo.extend((Requirement(r), f"{key} {version}") for r in requires)

os.makedirs(site, exist_ok=True)
for key in sorted(chosen):
    with zipfile.ZipFile(wheels[key][0]) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts[-1]:
                continue
            target = os.path.join(site, *parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                dst.write(src.read())
print("kept (this python's):", ", ".join(f"{k} {v}" for k, v in sorted(kept.items())) or "-")
print(f"unpacked into {site}:", ", ".join(f"{k} {v}" for k, v in sorted(chosen.items())) or "-")
for p in problems:
    print("PROBLEM:", p)
sys.exit(1 if problems else 0)
EOF

step environment 60 "$PYTHON" -c "
import sys, torch, transformers, triton
print('python', sys.version.split()[0], sys.executable)
print('torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__, '| triton', triton.__version__)
ok = torch.cuda.is_available()
print('gpu', torch.cuda.get_device_name() if ok else 'none', '| capability', torch.cuda.get_device_capability() if ok else '-',
      '| memory GiB', round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if ok else '-')
import numpy, pytest, nbval, nbformat, jupyter_client, ipykernel, kvlib
print('numpy', numpy.__version__, '| pytest', pytest.__version__, '| nbval', nbval.__version__, '| nbformat', nbformat.__version__,
      '| ipykernel', ipykernel.__version__, '| jupyter_client', jupyter_client.__version__, '| kvlib', kvlib.__version__, kvlib.__file__)
assert ok, 'no CUDA device'
"

# The committed outputs print "device cpu"; here it is "device cuda": the one expected difference.
SANITIZE=$(mktemp /tmp/nbval_sanitize_XXXX.cfg)
cat notebooks/nbval_sanitize.cfg - >"$SANITIZE" <<'EOF'

[the device notebook 10 prints first: cpu in the committed outputs, cuda on a GPU]
regex: \| device (cpu|cuda|mps)(:\d+)?
replace: | device DEVICE
EOF
step nbval_09 180 "$PYTHON" -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
    --nbval-sanitize-with "$SANITIZE" --nbval-cell-timeout 150 \
    notebooks/10_fused_decode_kernel.ipynb
step bench_kernel 240 "$PYTHON" benchmarks/bench_kernel.py --json "$OUT/results.json"
left=$((T_END - SECONDS - 5))
step gpu_check 240 "$PYTHON" scripts/gpu_check.py --time-limit $((left > 240 ? 140 : (left > 130 ? left - 100 : 30)))
echo "total $SECONDS s; $failed failed step(s)" | tee -a "$OUT/steps.txt"
exit "$failed"
