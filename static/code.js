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
document.querySelectorAll("pre code.language-python, pre code.language-cpp").forEach(function (el) {
  hljs.highlightElement(el);
});
