// docwarden ui: the action token, lease countdowns, and live updates (server-sent events,
// or polling when the browser has no EventSource or the stream keeps failing).
// Every value shown comes rendered and escaped from the server; this script only moves
// server-rendered HTML around and never builds markup from data.
(function () {
  "use strict";
  var KEY = "docwarden-token";

  function token() {
    var m = /[#&]token=([0-9a-f]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem(KEY, m[1]);
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem(KEY) || "";
  }

  function fillTokens() {
    var t = token();
    var input = document.getElementById("token-input");
    if (input && !input.value) input.value = t;
    document.querySelectorAll("input[name=token]").forEach(function (el) {
      el.value = t;
    });
  }

  var loadedAt = performance.now();
  function fmt(ms) {
    if (ms <= 0) return "expired " + Math.round(-ms / 1000) + " s ago";
    var s = Math.floor(ms / 1000);
    if (s < 120) return s + " s";
    return Math.floor(s / 60) + " min " + (s % 60) + " s";
  }
  function tick() {
    var spent = performance.now() - loadedAt;
    document.querySelectorAll(".countdown[data-remaining-ms]").forEach(function (el) {
      var left = Number(el.getAttribute("data-remaining-ms")) - spent;
      el.textContent = fmt(left);
      el.classList.toggle("expired", left <= 0);
    });
    document.querySelectorAll(".countup[data-elapsed-ms]").forEach(function (el) {
      var s = Math.floor((Number(el.getAttribute("data-elapsed-ms")) + spent) / 1000);
      el.textContent = s < 120 ? s + " s" : Math.floor(s / 60) + " min " + (s % 60) + " s";
    });
  }

  var pending = null;
  function refresh() {
    if (pending) return;
    pending = setTimeout(function () {
      pending = null;
      // Someone is typing in a form of the live area: refresh once they are done.
      var active = document.activeElement;
      var live = document.getElementById("live");
      if (active && live && live.contains(active) && active.tagName === "INPUT") {
        return setTimeout(refresh, 2000);
      }
      fetch(location.href, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) return;
          var doc = new DOMParser().parseFromString(html, "text/html");
          var fresh = doc.getElementById("live");
          var here = document.getElementById("live");
          if (fresh && here) {
            here.replaceWith(fresh);
            loadedAt = performance.now();
            fillTokens();
            tick();
          }
        })
        .catch(function () {});
    }, 300);
  }

  function status(text) {
    var el = document.getElementById("live-status");
    if (el) el.textContent = text;
  }

  var polling = null;
  function poll() {
    if (polling) return;
    status("(browser polling every 5 s)");
    polling = setInterval(refresh, 5000);
  }

  function live() {
    if (!window.EventSource) return poll();
    var failures = 0;
    var es = new EventSource("/events");
    es.addEventListener("hello", function (e) {
      failures = 0;
      var mode = document.getElementById("live-mode");
      if (mode) mode.textContent = e.data;
      status("(connected)");
    });
    es.addEventListener("change", refresh);
    es.onerror = function () {
      failures += 1;
      status("(reconnecting)");
      if (failures >= 3) {
        es.close();
        poll();
      }
    };
  }

  document.addEventListener("DOMContentLoaded", function () {
    fillTokens();
    var input = document.getElementById("token-input");
    if (input) {
      input.addEventListener("change", function () {
        sessionStorage.setItem(KEY, input.value.trim());
        fillTokens();
      });
    }
    tick();
    setInterval(tick, 1000);
    if (document.body.getAttribute("data-page") !== "reports") live();
  });
})();
