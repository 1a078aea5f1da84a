/* Kernel source highlighting on run pages, in the reader's browser (highlight.js, vendored under
 * static/highlight/: README.md there says which version and why). The page carries the source escaped in
 * <pre><code class="language-python|cpp">, so without this script (or JavaScript) it reads as plain text;
 * with it, highlight.js wraps tokens in <span class="hljs-…">, coloured by static/style.css in both themes.
 * A module (deferred by default) under script-src 'self'. */
import hljs from "./highlight/core.min.js";
import python from "./highlight/python.min.js";
import cpp from "./highlight/cpp.min.js";

hljs.registerLanguage("python", python);
hljs.registerLanguage("cpp", cpp);
// "raw solution.py": the file, made from the page's text (sitegen/highlight.py's page_gives_back says when
// that gives back the same bytes; otherwise the file is published beside the page and linked plainly).
document.querySelectorAll("a[data-raw-from]").forEach(function (a) {
  var code = document.getElementById(a.getAttribute("data-raw-from"));
  if (!code) return;
  a.href = URL.createObjectURL(new Blob([code.textContent], { type: "text/x-python" }));
  a.hidden = false;
});
document.querySelectorAll("pre code.language-python, pre code.language-cpp").forEach(function (el) {
  hljs.highlightElement(el);
});
