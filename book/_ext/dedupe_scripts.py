"""Drop repeated <script> tags from every page.

Under Jupyter Book 1.0.4, sphinx-thebe 0.3.1 and sphinx-togglebutton register their inline scripts
twice (once with no file name, once with an empty one, so Sphinx does not see them as equal). The
second THEBE copy throws "Identifier 'THEBE_JS_URL' has already been declared" in the browser.
"""


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        name = getattr(script, "filename", script) or ""  # None and "" both mean an inline script
        key = (str(name), repr(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique  # in place: later handlers append to this same list


def setup(app):
    # Last, after the handlers that add scripts to the page (none of them returns a template name,
    # which would stop the event before this one).
    app.connect("html-page-context", _dedupe, priority=999)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
