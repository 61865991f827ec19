# Sourced by scripts/demo and scripts/test: make (or reuse) .venv with nodeagent installed.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${NODEAGENT_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "nodeagent needs Python 3.11 or newer; '$python' is $("$python" --version 2>&1)" >&2
    exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv" >&2
    "$python" -m venv "$venv"
fi
stamp="$venv/.nodeagent-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    echo "installing nodeagent and its test dependencies into $venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -e "$root[test]" >&2
    touch "$stamp"
fi
