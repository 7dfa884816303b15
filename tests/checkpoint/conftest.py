"""The checkpoint tests (llmpar's own format and the foreign ones under ``llmpar/checkpoint/formats/``).

``tests/conftest.py`` puts ``tests/`` on ``sys.path`` (``multirank`` and the shared helpers); this directory goes
there too, so that the ranks of a pool started by any test can import these modules by name (``multirank`` runs a
test body on its ranks by module and qualified name) and the tests here import each other's helpers.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
