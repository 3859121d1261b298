"""What ``tools/plan.py`` and ``tools/analyze_logs.py`` call: the plan on
the fake backend (:mod:`.plan`), its memory model, and the layout search
(:func:`search_layouts`, docs/layout_search.md)."""
from mmpar.analysis.search import SearchResult, search_layouts

__all__ = ['SearchResult', 'search_layouts']
