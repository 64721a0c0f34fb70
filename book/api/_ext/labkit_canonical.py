"""Give every autodoc'd labkit function the name of the module that defines it, too.

A subpackage's page documents the names its ``__all__`` exports (``labkit.sharing.plan_sharing``);
the docstrings of the module that defines a function call it by its home name
(``plan_sharing`` inside ``labkit.sharing.instances``). Autodoc already records that home name as
``:canonical:`` for classes, so both spellings of a class resolve; this does the same for
functions, so a reference by either spelling resolves and one by a name labkit does not have
still fails the strict build.
"""

from sphinx.ext.autodoc import FunctionDocumenter


class CanonicalFunctionDocumenter(FunctionDocumenter):
    def add_directive_header(self, sig: str) -> None:
        super().add_directive_header(sig)
        module = getattr(self.object, "__module__", None)
        qualname = getattr(self.object, "__qualname__", None)
        if module and qualname and f"{module}.{qualname}" != self.fullname:
            self.add_line(f"   :canonical: {module}.{qualname}", self.get_sourcename())


def setup(app):
    app.setup_extension("sphinx.ext.autodoc")
    app.add_autodocumenter(CanonicalFunctionDocumenter, override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
