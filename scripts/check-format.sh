#!/usr/bin/env bash
# Fails, naming each file and line, where kdn's C++ and CUDA sources differ
# from what scripts/format.sh would make of them (clang-format-14 and
# .clang-format). CI runs it from scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
if ! command -v "$CLANG_FORMAT" >/dev/null; then
  echo "check-format: $CLANG_FORMAT is missing (scripts/install-deps.sh --ref installs it)" >&2
  exit 1
fi
if ! scripts/format-files.sh | xargs -r "$CLANG_FORMAT" --dry-run --Werror --style=file; then
  echo "check-format: the files above are not formatted; scripts/format.sh formats them" >&2
  exit 1
fi
echo "check-format: $(scripts/format-files.sh | wc -l) files formatted"
