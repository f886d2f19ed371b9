"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``). Not part of the site (``exclude_docs``).

cfdist's docstrings cross-reference in reST (``:class:`~cfdist.Checkpointer```), which
mkdocstrings' Google-style parser leaves as text: ``:class:`` followed by the code span. This
drops the role and, for ``~``, keeps the last component, as Sphinx shows it.
"""

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]+)</code>")


def _plain(m: re.Match) -> str:
    name = m.group(2).split(".")[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_page_content(html, **kwargs):
    return _ROLE.sub(_plain, html)
