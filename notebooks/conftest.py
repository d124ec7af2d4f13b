"""nbval runs the notebooks headless: no front end answers widget messages there, and nbclient
can wait on them until the cell timeout (jupyter/nbclient#312). ``KVLIB_HEADLESS=1`` makes
``kvlib.plot.interactive()`` false, so the notebooks build no widgets; kernels started by nbval
inherit it. ``scripts/nb.py`` (``make run``, ``make notebooks``) sets the same."""

import os

os.environ["KVLIB_HEADLESS"] = "1"
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
