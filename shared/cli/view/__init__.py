"""`veribus view`: a local, self-contained web app over the results store and the bus.

Pages (server-rendered HTML, a little vanilla JS for live refresh):

- `/`                               Runs: every run, its progress and state (live).
- `/run/{run_id}`                   Run: pass rates per model and judge, heat map, errors,
                                    traits, latency and tokens, and a filtered, paged sample list.
- `/run/{run_id}/sample/{result_id}` Sample: everything about one result.
- `/compare`                        Compare two runs, or two models of one run (paired).

Every page reads ClickHouse with aggregates or LIMITed queries (`shared.cli.view.queries`), so a
run of 100k results is never loaded into memory. Assets ship in `shared/cli/view/static/`.
"""

from shared.cli.view.filters import Filters
from shared.cli.view.server import build_app, serve

__all__ = ["Filters", "build_app", "serve"]
