"""The on-demand bench scripts (soak, faults, long-context, ...) import. `make test` runs none of
them, so a function that moves breaks them silently: bench/faults.py could not start for a while
because it imported set_in_file from engine.config after that moved to engine.config_file."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# each script as its own module, with the paths the scripts themselves put first
IMPORT_ALL = """
import importlib.util, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root / "bench"), str(root), str(root / "tests")]
for path in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location("bench_" + Path(path).stem, path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        print(f"{path}: {e!r}")
"""


def test_every_bench_script_imports():
    scripts = sorted(str(p) for p in (ROOT / "bench").glob("*.py")
                     if not p.name.startswith("test_") and p.name != "conftest.py")
    assert len(scripts) > 10
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(ROOT), *scripts],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_every_project_name_the_bench_scripts_import_inside_functions_exists():
    """Imports inside functions run only when that code does: bench/step_overhead.py imported parse_value
    from engine.config after it moved to engine.config_file, and failed only when run."""
    project = {"engine", "ops", "server", "console"}
    missing = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in project:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(
                            f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
    assert not missing
