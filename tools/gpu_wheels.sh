#!/usr/bin/env bash
# Download tools/gpu_wheels.txt as Python 3.12 x86-64 Linux wheels into DIR (default .whl/, ignored by git),
# where there is network, and Debian's bubblewrap (the grader's sandbox) unpacked into DIR/bwrap where apt-get
# can fetch it; carry DIR to the GPU machine and run `python3 tools/gpu_check.py --wheels DIR`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" -r tools/gpu_wheels.txt
if command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
  deb=$(mktemp -d)
  if (cd "$deb" && apt-get download -qq bubblewrap >/dev/null 2>&1); then
    rm -rf "$dest/bwrap" && dpkg -x "$deb"/bubblewrap_*.deb "$dest/bwrap" && echo "bubblewrap: $dest/bwrap/usr/bin/bwrap"
  else
    echo "bubblewrap: apt-get could not download it; the GPU check grades without the sandbox where bwrap is missing"
  fi
  rm -rf "$deb"
fi
echo "$(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
