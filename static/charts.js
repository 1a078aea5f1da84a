/* kernelboard — draws every chart of a page from its JSON data block (sitegen/charts.py).
   Loaded after plotly.min.js with `defer`; no inline script anywhere, so the pages' CSP can say
   script-src 'self'. Chart colours follow the page theme: each colour listed in the block's
   "theme" map is replaced by the CSS custom property it names (static/style.css). On a phone
   (PHONE_QUERY) the mode bar is hidden: it would cover the chart's title, and zooming a chart whose
   every figure is in the hover and in the table beside it is not worth that; a block's "phone" map
   replaces those keys of the layout there (sitegen/charts.py decides both layouts). */
(function () {
  "use strict";
  var PHONE_QUERY = "(max-width: 600px)";
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
      var config = Object.assign({}, spec.config || {});
      var layout = fig.layout || {};
      if (window.matchMedia && window.matchMedia(PHONE_QUERY).matches) {
        config.displayModeBar = false;
        if (spec.phone) {  // a taller layout, e.g. room for a legend of one entry a line
          layout = Object.assign({}, layout, themed(spec.phone, colors));
          if (layout.height) { target.style.height = layout.height + "px"; }
        }
      }
      window.Plotly.newPlot(target, fig.data || [], layout, config);
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
