/* GPU tabs on the home page, as progressive enhancement: without this script every GPU's section is shown,
 * one after another, and the links in nav[data-tabs] jump to them. With it, the links become tabs (ARIA
 * tablist, arrow keys, Home/End) and one section shows at a time; the URL hash keeps the choice, and a hash
 * pointing inside a section (a board's anchor) opens that section. Runs under script-src 'self'. */
(function () {
  "use strict";

  function init(nav) {
    var links = [], panels = [];
    Array.prototype.forEach.call(nav.querySelectorAll("a[href^='#']"), function (a) {
      var panel = document.getElementById(a.getAttribute("href").slice(1));
      if (panel && panel.tagName === "SECTION" && panel.classList.contains("gpu")) {
        links.push(a);
        panels.push(panel);
      }
    });
    if (links.length < 2) return;
    nav.setAttribute("role", "tablist");
    nav.classList.add("tabs");

    function select(i, focus) {
      links.forEach(function (a, j) {
        var on = i === j;
        a.setAttribute("aria-selected", on ? "true" : "false");
        a.tabIndex = on ? 0 : -1;
        panels[j].hidden = !on;
      });
      if (focus) links[i].focus();
    }

    function fromHash() {
      var target = location.hash ? document.getElementById(decodeURIComponent(location.hash.slice(1))) : null;
      for (var i = 0; target && i < panels.length; i++) {
        if (panels[i].contains(target)) return i;
      }
      return -1;
    }

    links.forEach(function (a, i) {
      a.setAttribute("role", "tab");
      if (!a.id) a.id = "tab-" + panels[i].id;
      a.setAttribute("aria-controls", panels[i].id);
      panels[i].setAttribute("role", "tabpanel");
      panels[i].setAttribute("aria-labelledby", a.id);
      a.addEventListener("click", function (event) {
        event.preventDefault();
        select(i, false);
        if (history.replaceState) history.replaceState(null, "", "#" + panels[i].id);
      });
      a.addEventListener("keydown", function (event) {
        var next = {ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: links.length - 1}[event.key];
        if (next === undefined) return;
        event.preventDefault();
        next = (next + links.length) % links.length;
        select(next, true);
        if (history.replaceState) history.replaceState(null, "", "#" + panels[next].id);
      });
    });
    window.addEventListener("hashchange", function () {
      var i = fromHash();
      if (i >= 0) select(i, false);
    });
    var start = fromHash();
    select(start >= 0 ? start : 0, false);
  }

  Array.prototype.forEach.call(document.querySelectorAll("nav[data-tabs]"), init);
})();
