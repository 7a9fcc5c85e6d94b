#!/bin/bash
# Prepares the wheels that .ci/gpu/check.sh installs on a lent GPU machine (no network
# there; Python 3.12 with numpy, torch, transformers, tokenizers, pytest and xdist). Run
# here, from the repo root, with make install done: it writes .gpu1/ (the first part of
# mlx-cuda-13's 90 MB wheel) and .gpu2/ (its rest and every other wheel), each under the
# device tool's 64 MiB a call, both ignored by git through .git/info/exclude.
# Then, on the device: carry .gpu1 with `cp .gpu1/cu13.part1 /tmp/`, and at once (the
# machine stays warm 30 s) carry .gpu2 with `bash .ci/gpu/check.sh`.
set -eu
PY=.venv/bin/python
grep -qx '/.gpu1/' .git/info/exclude 2>/dev/null || printf '/.gpu1/\n/.gpu2/\n' >> .git/info/exclude
rm -rf .gpu1 .gpu2 /tmp/kvchat-wheels && mkdir -p .gpu1 .gpu2 /tmp/kvchat-wheels
MLX=$($PY -c "import importlib.metadata as m; print(m.version('mlx'))")
# what the GPU machine's image lacks (or has too old), at the versions this checkout runs
# with where it has them (pip's names normalised: pydantic_core is pydantic-core)
NEED="mlx-lm textual platformdirs tomlkit pydantic pydantic-core annotated-types
typing-inspection starlette uvicorn llguidance openai distro jiter sniffio
pytest-textual-snapshot syrupy mdit-py-plugins linkify-it-py uc-micro-py rich typer
typing-extensions markdown-it-py mdurl pygments click shellingham annotated-doc anyio h11"
HAVE=$($PY -m pip list --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
PINS=$(for n in $NEED; do echo "$HAVE" | grep -m1 "^$n==" || echo "$n"; done)
PLAT="--platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d /tmp/kvchat-wheels "mlx==$MLX" "mlx-cuda-13==$MLX" $PINS "setuptools>=77"  # pyproject.toml's build floor
W=$(ls /tmp/kvchat-wheels/mlx_cuda_13-"$MLX"-*.whl)
[ "$(basename "$W")" = "mlx_cuda_13-$MLX-py3-none-manylinux_2_35_x86_64.whl" ] || { echo "unexpected name: $W"; exit 1; }
head -c 58000000 "$W" > .gpu1/cu13.part1
tail -c +58000001 "$W" > .gpu2/cu13.part2
echo "$MLX" > .gpu2/mlx-version
find /tmp/kvchat-wheels -name '*.whl' ! -name 'mlx_cuda_13-*' -exec cp {} .gpu2/ \;
du -sh .gpu1 .gpu2
