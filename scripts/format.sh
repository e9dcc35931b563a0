#!/usr/bin/env bash
# Formats kdn's C++ and CUDA sources in place with clang-format-14 and
# .clang-format (scripts/install-deps.sh --ref installs it). Extra arguments
# are files to format instead of all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
if [ $# -gt 0 ]; then
  "$CLANG_FORMAT" -i --style=file "$@"
else
  scripts/format-files.sh | xargs -r "$CLANG_FORMAT" -i --style=file
fi
