#!/usr/bin/env bash
# Fails when a file of the project speaks of how the project was developed instead of
# what the library is: numbered rounds of work, tracker issue numbers, or the
# vocabulary of a GPU rental service. Run by CTest as docs.forbidden_words; by hand:
#
#   tests/forbidden_words.sh [SOURCE_DIR]
#
# Prints path:line:text for every hit and exits 1 if there is one. The files are the
# ones git tracks or would add (all files but build and result folders when SOURCE_DIR
# is not a git checkout); binary files are skipped, and so is this file, which holds
# the patterns. The patterns match words, so that library vocabulary passes: Catch2's
# Catch::Session, a rounding carry, upstream references such as "DeepSpeed #7981".
set -uo pipefail
root="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
self="tests/forbidden_words.sh"

# Extended regular expressions, case-sensitive (letter case spelled out where it varies).
patterns=(
  '\b[Ss]essions? [0-9]'                         # numbered rounds of work
  '\b[Ii]ssues? #?[0-9]'                         # tracker issue numbers
  '\b[Ss]tops? [0-9]+\b'                         # numbered CI stops
  '\b[Dd]evice[- ]time\b'                        # a rental service's metered time
  '\b[Dd]evice tool\b'
  '\b([Dd]evice|GPU) calls?\b'
  '\b[Ll]ent\b'
  '\b[Ll]ease[sd]?\b'
  '\b[Bb]udget(s|_left|_s)?\b'
  '\bGPU_RUN_BUDGET'
  '\$\{?OUT\b'                                   # the service's output folder
  '\b[Cc]arr(y|ies|ied|ying):? ?\["'             # what a call carries to the machine
  '\b[Cc]arr(y|ies|ied|ying) [^ ]*\.(gpu|deps)\b'
)

cd "$root" || exit 2
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked files, and new ones git does not ignore (those a commit would add).
  mapfile -d '' files < <(git -C "$root" ls-files -z --cached --others --exclude-standard)
else
  mapfile -d '' files < <(find . -type f \
    -not -path './.git/*' -not -path './build*' -not -path './out/*' -not -path './results/*' \
    -not -path './.deps/*' -not -path './.gpu/*' -not -path './.venv/*' -not -path './.whl/*' -print0 |
    sed -z 's|^\./||')
fi

args=()
for p in "${patterns[@]}"; do args+=(-e "$p"); done
hits=0
checked=0
for f in "${files[@]}"; do
  [ "$f" = "$self" ] && continue
  [ -f "$f" ] || continue  # deleted in the working tree
  checked=$((checked + 1))
  if found="$(grep -nIE "${args[@]}" -- "$f")"; then
    while IFS= read -r line; do
      printf '%s:%s\n' "$f" "$line"
      hits=$((hits + 1))
    done <<<"$found"
  fi
done

if [ "$hits" -gt 0 ]; then
  echo "forbidden_words: $hits line(s) in $checked files speak of the project's development, not of the library" >&2
  exit 1
fi
echo "forbidden_words: $checked files, no development history"
