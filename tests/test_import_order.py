"""Every minillm module imports on its own, first, in a fresh interpreter's state (no import circles).

An import circle through a package's `__init__` hides from module-level import graphs: `minillm.sampler.speculative`
imported `minillm.engine.*`, whose package `__init__` imports `llm_engine`, which imports `minillm.sampler.speculative`.
It worked whenever something had imported `minillm.engine` first, and `import minillm.sampler.speculative` alone failed.
Here each module is imported with every `minillm` module forgotten beforehand (torch stays loaded, so it takes
seconds), in a subprocess so that the test process keeps its own modules.
"""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import minillm
names = sorted(m.name for m in pkgutil.walk_packages(minillm.__path__, "minillm.", onerror=lambda name: None)
               if not m.name.endswith("__main__"))
failed = []
for name in names:
    for loaded in [k for k in sys.modules if k == "minillm" or k.startswith("minillm.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
print(len(names), "modules")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_and_alone():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, "a module fails when it is the first minillm module imported (an import circle?):\n" \
        + run.stdout + run.stderr[-2000:]
    assert int(run.stdout.split()[0]) > 50, run.stdout
