# Shared by the ops scripts: make sure .venv exists and holds the project with its test extras.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
# The stamp names what the install depends on: the metadata, and the compiled kernels' sources
# (pip builds them in place; a changed kernel is built again by installing again).
STAMP="$VENV/.installed-$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/delayserver/native/*.pyx "$ROOT"/delayserver/native/*.pxd "$ROOT"/delayserver/native/*.h | sha1sum | cut -c1-12)"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
    # The install compiles the kernels of delayserver/native: a C compiler and xxhash's header and
    # library (the dedupe keys' hash), from Debian's packages.
    needed=()
    command -v cc >/dev/null 2>&1 || needed+=(gcc)
    [ -f /usr/include/xxhash.h ] || needed+=(libxxhash-dev)
    if [ "${#needed[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing from Debian's packages: ${needed[*]}" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >&2
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# The project is installed editable, so pip compiled none of its modules: compile them here (only
# what changed since the last time), or every process the scripts and tests start compiles them
# again when Python runs with PYTHONDONTWRITEBYTECODE set (README says what it costs).
# A module that does not compile is reported here (on stderr) and again by whatever imports it.
"$VENV/bin/python" -m compileall -q "$ROOT/delayserver" "$ROOT/bench" "$ROOT/spark" "$ROOT/tests" >&2 || true
