// Typesets the formulas of the docs (pymdownx.arithmatex, generic mode: each formula is an
// element of class "arithmatex" holding \( ... \) or \[ ... \]) with the KaTeX vendored in
// docs/assets/katex/, so the math renders from file:// with no network. document$ is
// mkdocs-material's page observable: it fires on the first load and after instant navigation.
document$.subscribe(() => {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
