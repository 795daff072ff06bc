#!/usr/bin/env bash
# Installs Debian's dataset-fashion-mnist if its files are missing. Idempotent.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
missing=0
for f in "${files[@]}"; do [ -s "$dir/$f" ] || missing=1; done
[ "$missing" = 0 ] && exit 0

echo "Fashion-MNIST is missing under $dir: installing Debian's dataset-fashion-mnist" >&2
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist
else
  echo "error: cannot install it without root; run as root: apt-get install dataset-fashion-mnist" >&2
  exit 1
fi
