// "Make it live": the course's explorers running in the reader's browser. Pyodide (CPython in WebAssembly, served
// from this site) runs the explorer's own Python (gpipe_ref.widgets: its simulator, its pictures); this file draws
// its ipywidgets tree as plain HTML controls and sends each move back (website/live/bridge.py). Nothing is fetched
// until a reader presses a button.
const STATIC = new URL(".", import.meta.url);  // this site's _static/
let runtime = null;  // one Pyodide for the page, started by the first press

async function startRuntime() {
  const { loadPyodide } = await import(new URL("vendor/pyodide/pyodide.mjs", STATIC));
  const pyodide = await loadPyodide({ indexURL: new URL("vendor/pyodide/", STATIC).href });
  const listing = await (await fetch(new URL("live/files.json", STATIC))).json();
  for (const [path, format] of listing) {
    const bytes = new Uint8Array(await (await fetch(new URL(path, STATIC))).arrayBuffer());
    pyodide.unpackArchive(bytes, format);
  }
  pyodide.runPython("import bridge");
  return pyodide.pyimport("bridge");
}

function element(tag, props = {}, children = []) {
  const el = Object.assign(document.createElement(tag), props);
  for (const child of children) el.append(child);
  return el;
}

const BOXES = { VBox: "column", HBox: "row", Box: "row" };
const SELECTIONS = ["Dropdown", "ToggleButtons", "RadioButtons", "SelectionSlider", "Select"];

// One widget node as an element; `send(id, value)` reports a move. Each element keeps its node's id.
function draw(node, send) {
  let el;
  // a control's label names it for screen readers too (its `for` is the control's id, the widget's model id)
  const label = node.description
    ? element("label", { textContent: node.description, className: "live-label", htmlFor: `live-${node.id}` }) : null;
  if (BOXES[node.kind]) {
    el = element("div", { className: "live-box" }, node.children.map((c) => draw(c, send)));
    el.style.flexDirection = BOXES[node.kind];
  } else if (node.kind === "HTML" || node.kind === "Label") {
    el = element("div", { className: "live-html", innerHTML: node.value });
  } else if (node.kind.endsWith("Slider") && !SELECTIONS.includes(node.kind)) {
    const input = element("input", { type: "range", min: node.min, max: node.max, step: node.step, value: node.value });
    const shown = element("output", { textContent: node.value });
    input.addEventListener("input", () => { shown.textContent = input.value; });
    input.addEventListener("change", () => send(node.id, input.value));
    el = element("div", { className: "live-control" }, [label ?? "", input, shown]);
  } else if (SELECTIONS.includes(node.kind)) {
    const select = element("select", {}, node.options.map((o, i) => element("option", { value: i, textContent: o })));
    select.value = String(node.index);
    select.addEventListener("change", () => send(node.id, select.value));
    el = element("div", { className: "live-control" }, [label ?? "", select]);
  } else if (node.kind === "Checkbox") {
    const box = element("input", { type: "checkbox", checked: node.value });
    box.addEventListener("change", () => send(node.id, box.checked));
    el = element("div", { className: "live-control" }, [box, label ?? ""]);
  } else if (node.kind.endsWith("Text") || node.kind === "Textarea") {
    const area = node.kind === "Textarea" ? element("textarea", { rows: node.rows || 6, value: node.value })
      : element("input", { type: node.kind.includes("Int") || node.kind.includes("Float") ? "number" : "text",
        value: node.value, min: node.min ?? "", max: node.max ?? "" });
    area.addEventListener("change", () => send(node.id, area.value));
    el = element("div", { className: "live-control" }, [label ?? "", area]);
  } else if (node.kind === "Button") {
    el = element("button", { textContent: node.description, title: node.tooltip || "", disabled: node.disabled });
    el.addEventListener("click", () => send(node.id, null));
  } else {
    el = element("div", { className: "live-unknown", textContent: `(${node.kind})` });
  }
  el.dataset.id = node.id;
  const control = BOXES[node.kind] ? null : el.querySelector("input, select, textarea");
  if (control) control.id = `live-${node.id}`;
  for (const cls of node.classes || []) el.classList.add(cls);
  if (node.disabled) el.querySelectorAll("input, select, textarea, button").forEach((c) => { c.disabled = true; });
  return el;
}

// Make the explorer behind `button` live: drawn where its saved view was, which is hidden (and shown again if the
// start fails); the saved view stays in the page for print and as the fallback.
async function makeLive(button) {
  const { factory } = button.dataset;
  const options = JSON.parse(button.dataset.options || "{}");
  const note = button.closest("p") ?? button.parentElement;
  const holder = button.closest(".output") ?? note;
  const status = element("span", { className: "live-status", textContent: " starting Python in this page..." });
  button.disabled = true;
  button.after(status);
  try {
    runtime ??= startRuntime();
    const bridge = await runtime;
    const host = element("div", { className: "live-explorer" });
    host.dataset.factory = factory;
    const render = (json) => { host.replaceChildren(draw(JSON.parse(json), send)); };
    const send = (id, value) => {  // a move the explorer refuses is said under it; the explorer stays as it was
      try {
        render(bridge.set_value(factory, id, value));
      } catch (error) {
        host.append(element("p", { className: "live-error", textContent: `not taken: ${error.message}` }));
      }
    };
    render(bridge.start.callKwargs(factory, options));
    holder.before(host);
    for (const saved of holder.parentElement.children) {
      if (saved !== host && saved !== holder) saved.classList.add("live-replaced");
    }
    note.replaceChildren("Live: this explorer's own Python runs in this page (Pyodide), and every move re-runs it.");
  } catch (error) {
    runtime = null;
    status.textContent = ` could not start: ${error.message}`;
    button.disabled = false;
    throw error;
  }
}

for (const button of document.querySelectorAll("button.gpipe-make-live")) {
  button.addEventListener("click", () => makeLive(button));
}
