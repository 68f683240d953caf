// ipywidgets 8's html-manager typesets widget labels with MathJax 2's API (MathJax.Hub.Queue);
// MathJax 3 has no Hub, so without this every widget label throws "reading 'Queue'".
(function () {
  const queue = (...commands) => {
    for (const command of commands) {
      const mj = window.MathJax;
      if (Array.isArray(command) && command[0] === "Typeset" && mj && mj.startup && mj.startup.promise) {
        mj.startup.promise.then(() => mj.typesetPromise([command[2]]));
      }
    }
  };
  let current = window.MathJax;
  Object.defineProperty(window, "MathJax", {
    configurable: true,
    get() { return current; },
    set(value) {
      current = value;
      if (value && typeof value === "object" && !value.Hub) value.Hub = { Queue: queue };
    },
  });
  window.MathJax = current;
})();
