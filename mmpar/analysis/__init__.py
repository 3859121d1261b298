"""What ``tools/plan.py`` and ``tools/analyze_logs.py`` call: the plan on
the fake backend (:mod:`.plan`), its memory model, and the layout search in
the launched job (:func:`~mmpar.analysis.job_search.search_in_job`,
docs/layout_search.md)."""
from mmpar.analysis.search_table import SearchResult

__all__ = ['SearchResult']
