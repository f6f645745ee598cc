# The project's Python environments, one place for all scripts. Source it:
#
#   source scripts/venv.sh demo    # target/venv/demo: what scripts/demo.sh needs (numpy, gguf)
#   source scripts/venv.sh test    # target/venv/test: the test suite's Python peers
#   source scripts/venv.sh llama   # target/venv/llama: bench_run.sh's llama.cpp peer
#   source scripts/venv.sh serve   # target/venv/serve: the openai and anthropic clients tests/it/serve.rs drives
#   source scripts/venv.sh tiktoken # target/venv/tiktoken: tiktoken, the Kimi tokenizer golden's reference
#
# It makes target/venv/NAME from the pinned scripts/requirements/requirements-*.txt of NAME with the
# interpreter behind the `python3` on PATH, and puts its bin/ first on PATH, so that every `python3` (and
# `hf`) after it, including those the Rust tests start, is that environment's. Nothing is
# ever installed into the interpreter it was made from. The venv is reused while its
# stamp (interpreter version and requirement files) matches, and made anew when it does
# not, so it never holds packages an older requirement list installed.
# GTURBO_VENV_ROOT moves the venvs elsewhere (the default is target/venv).

gturbo_venv() {
  local name="$1" root req reqs stamp dir base
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  case "$name" in
    demo) reqs=(requirements-demo.txt) ;;
    test) reqs=(requirements-ci.txt requirements-check.txt) ;;
    llama) reqs=(requirements-llama.txt) ;;
    serve) reqs=(requirements-serve.txt) ;;
    tiktoken) reqs=(requirements-tiktoken.txt) ;;
    *) echo "venv.sh: unknown environment '$name' (demo | test | llama | serve | tiktoken)" >&2; return 2 ;;
  esac
  command -v python3 >/dev/null || { echo "venv.sh: python3 is required" >&2; return 2; }
  # The interpreter behind `python3`, even when a venv (this one's, another's) is first on
  # PATH: the new venv must not hang off one that is about to be removed.
  base=$(python3 -c 'import sys; print(getattr(sys, "_base_executable", "") or sys.executable)')
  dir="${GTURBO_VENV_ROOT:-$root/target/venv}/$name"
  # The stamp covers the interpreter and each requirement file, `-r` includes too.
  local files=() queue=("${reqs[@]}") inc
  while [ ${#queue[@]} -gt 0 ]; do
    files+=("${queue[0]}")
    for inc in $(sed -n 's/^-r[[:space:]]*//p' "$root/scripts/requirements/${queue[0]}"); do queue+=("$inc"); done
    queue=("${queue[@]:1}")
  done
  # The venv's own path too: its scripts' shebangs name it, so a venv made under another
  # path (a moved or symlinked target/) is made anew instead of failing to exec.
  stamp="$("$base" -c 'import sys; print(sys.version)' | tr -d '\n'; echo " $name $dir")
$(cd "$root/scripts/requirements" && sha256sum "${files[@]}")"
  if [ ! -f "$dir/.gturbo-stamp" ] || [ "$(cat "$dir/.gturbo-stamp")" != "$stamp" ]; then
    echo "venv.sh: making $dir" >&2
    rm -rf "$dir"
    if ! "$base" -m venv "$dir"; then
      echo "venv.sh: \`$base -m venv\` failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
      return 2
    fi
    local args=()
    for req in "${reqs[@]}"; do args+=(-r "$root/scripts/requirements/$req"); done
    "$dir/bin/python3" -m pip install -q --disable-pip-version-check "${args[@]}" || {
      echo "venv.sh: installing ${reqs[*]} into $dir failed" >&2
      return 2
    }
    printf '%s\n' "$stamp" > "$dir/.gturbo-stamp"
  fi
  export PATH="$dir/bin:$PATH" VIRTUAL_ENV="$dir"
  hash -r
}

gturbo_venv "$@"
