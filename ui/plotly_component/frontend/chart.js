// Draws the Plotly figure that ui/plotly_component/__init__.py sends: the default export of a
// Streamlit component (st.components.v2), called with the chart's element and its data (figure,
// config, plotly_url) when the chart appears and again after every script run that changes it.
// plotly.js's basic bundle is loaded once per browser tab, by a <script> element in the page's
// head (it sets window.Plotly); every chart of the tab draws with it, in the page itself.

function loadPlotly(url) {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!window.__gpumixPlotly) {
    window.__gpumixPlotly = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = url;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => reject(new Error(`plotly.js did not load from ${url}`));
      document.head.appendChild(script);
    });
  }
  return window.__gpumixPlotly;
}

// The page's text font and colour under the figure, as a Plotly template: what the figure sets wins.
function template(el) {
  const style = getComputedStyle(el);
  const text = style.color;
  const font = style.fontFamily;
  const grid = "rgba(128,128,128,0.25)";
  const axis = { gridcolor: grid, zerolinecolor: grid, tickcolor: grid, automargin: true,
                 tickfont: { color: text, size: 12 }, title: { font: { color: text, size: 14 } } };
  return { layout: {
    font: { family: font, color: text, size: 12 },
    title: { font: { family: font, color: text, size: 16 } },
    legend: { font: { color: text, size: 12 } },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    // Streamlit's categorical chart colours, for traces without a colour of their own
    colorway: ["#0068c9", "#83c9ff", "#ff2b2b", "#ffabab", "#29b09d", "#7defa1", "#ff8700",
               "#ffd16a", "#6d3fc0", "#d5dae5"],
    xaxis: Object.assign({}, axis, { showgrid: false }), yaxis: axis,
    hoverlabel: { font: { family: font, size: 12 } },
  } };
}

export default function ({ parentElement, data }) {
  const chart = parentElement.querySelector(".gpumix-chart");
  if (!chart || !data) return;
  const fig = data.figure || {};
  const layout = Object.assign({}, fig.layout || {}, { template: template(chart), autosize: true });
  const config = data.config || {};
  loadPlotly(data.plotly_url)
    .then((Plotly) => {
      Plotly.react(chart, fig.data || [], layout, config);
      followWidth(chart, Plotly);
    })
    .catch((err) => { chart.textContent = String(err); });
}

// Full width when the column's width changes (a window resized, the sidebar folded), as
// st.plotly_chart does: Plotly lays a chart out again only when asked.
function followWidth(chart, Plotly) {
  if (chart.__widthObserver) return;
  let width = chart.clientWidth;
  chart.__widthObserver = new ResizeObserver(() => {
    if (chart.clientWidth !== width && chart._fullLayout) {
      width = chart.clientWidth;
      Plotly.Plots.resize(chart);
    }
  });
  chart.__widthObserver.observe(chart);
}
