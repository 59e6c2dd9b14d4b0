#!/usr/bin/env bash
# Type-checks the package with mypy (settings: pyproject.toml's [tool.mypy]).
# mypy reads packages from the file system, and feature_column/ and ops/
# are subpackages of group_embedding only once installed (setup.py's
# package_dir), so it checks a mirror of that layout made of symlinks.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MIRROR=$(mktemp -d)
trap 'rm -rf "$MIRROR"' EXIT
mkdir "$MIRROR/group_embedding"
for entry in "$ROOT"/group_embedding/*; do
    ln -s "$entry" "$MIRROR/group_embedding/"
done
ln -s "$ROOT/feature_column" "$MIRROR/group_embedding/feature_column"
ln -s "$ROOT/ops" "$MIRROR/group_embedding/ops"
cd "$MIRROR"
exec "$ROOT/.venv/bin/mypy" --config-file "$ROOT/pyproject.toml" \
    --cache-dir "$MIRROR/.mypy_cache" -p group_embedding "$@"
