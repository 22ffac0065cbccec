"""A visible, labelled "Open in Colab" link under the title of every notebook page.

The theme's launch menu hides Colab behind an unlabelled rocket icon; a learner should see at once
where to run the page. The link opens this notebook from the course's repository (``repository`` in
_config.yml, the one place its address lives).
"""
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

LABEL = "Open in Colab"


def colab_url(app, docname: str) -> str:
    repo = app.config.html_theme_options.get("repository_url", "").rstrip("/")
    branch = app.config.html_theme_options.get("repository_branch", "main") or "main"
    slug = repo.split("github.com/", 1)[-1]
    return f"https://colab.research.google.com/github/{slug}/blob/{branch}/{docname}.ipynb"


def _link(url: str, label: str = LABEL) -> str:
    return (f'<p class="kc-colab"><a class="kc-colab-link" href="{url}" target="_blank" rel="noopener">'
            f'{label}</a> <span class="kc-colab-hint">runs this notebook on a free GPU</span></p>')


class ColabButton(SphinxDirective):
    """``{colab-button} notebooks/01_vector_add``: the labelled Colab link for that notebook, on any page."""

    required_arguments = 1
    final_argument_whitespace = True
    has_content = True

    def run(self):
        label = " ".join(self.content).strip() or LABEL
        return [nodes.raw("", _link(colab_url(self.env.app, self.arguments[0].strip()), label), format="html")]


def _add_link(app, doctree, docname):
    if app.builder.format != "html" or not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    html = _link(colab_url(app, docname))
    title = next(iter(section.findall(nodes.title)), None)
    section.insert(section.index(title) + 1 if title is not None else 0, nodes.raw("", html, format="html"))


def setup(app):
    app.add_directive("colab-button", ColabButton)
    app.connect("doctree-resolved", _add_link)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
