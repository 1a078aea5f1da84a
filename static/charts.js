/* kernelboard — draws every chart of a page from its JSON data block (sitegen/charts.py).
   Loaded after plotly.min.js with `defer`; no inline script anywhere, so the pages' CSP can say
   script-src 'self'. Chart colours follow the page theme: each colour listed in the block's
   "theme" map is replaced by the CSS custom property it names (static/style.css). */
(function () {
  "use strict";
  function themed(value, colors) {
    if (typeof value === "string") {
      return Object.prototype.hasOwnProperty.call(colors, value) ? colors[value] : value;
    }
    if (Array.isArray(value)) { return value.map(function (v) { return themed(v, colors); }); }
    if (value && typeof value === "object") {
      var out = {};
      Object.keys(value).forEach(function (k) { out[k] = themed(value[k], colors); });
      return out;
    }
    return value;
  }
  function draw() {
    if (typeof window.Plotly === "undefined") { return; }
    var style = window.getComputedStyle(document.documentElement);
    document.querySelectorAll('script[type="application/json"].chart-data').forEach(function (block) {
      var target = document.getElementById(block.getAttribute("data-for"));
      if (!target) { return; }
      var spec = JSON.parse(block.textContent);
      var colors = {};
      Object.keys(spec.theme || {}).forEach(function (hex) {
        var css = style.getPropertyValue(spec.theme[hex]).trim();
        if (css) { colors[hex] = css; }
      });
      var fig = themed(spec.figure, colors);
      window.Plotly.newPlot(target, fig.data || [], fig.layout || {}, spec.config || {});
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
