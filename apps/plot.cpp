// A small log-log line chart as SVG, written by hand (no dependencies).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "commands.h"
#include "dimattn/error.h"

namespace dimattn::cli {
namespace {

constexpr double kPanelW = 340, kPanelH = 300;                     // one panel, axes included
constexpr double kLeft = 62, kRight = 14, kTop = 50, kBottom = 46;  // plot area insets within a panel
constexpr double kLegendW = 330, kRowH = 16;
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                               "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
const char* const kDashes[] = {"", "6,3", "2,2", "8,3,2,3"};

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// A log10 axis over [lo, hi] mapped onto pixels [p0, p1].
struct LogAxis {
  double lo, hi, p0, p1;
  LogAxis(double min, double max, double p0_, double p1_) : p0(p0_), p1(p1_) {
    lo = std::log10(min), hi = std::log10(max);
    const double pad = std::max(0.08 * (hi - lo), 0.15);  // a single value still gets a range
    lo -= pad, hi += pad;
  }
  double px(double v) const { return p0 + (std::log10(v) - lo) / (hi - lo) * (p1 - p0); }
  bool within(double v) const { return std::log10(v) >= lo && std::log10(v) <= hi; }
  // 1, 2, 5 x 10^k inside the range; only powers of ten when that gives too many.
  std::vector<double> ticks() const {
    std::vector<double> all, decades;
    for (int e = static_cast<int>(std::floor(lo)); e <= static_cast<int>(std::ceil(hi)); ++e)
      for (double m : {1.0, 2.0, 5.0}) {
        const double v = m * std::pow(10.0, e);
        if (!within(v)) continue;
        all.push_back(v);
        if (m == 1.0) decades.push_back(v);
      }
    return all.size() <= 8 || decades.size() < 2 ? all : decades;
  }
};

}  // namespace

void write_svg_plot(const std::string& path, const std::string& title, const std::string& x_label,
                    const std::string& y_label, const std::vector<PlotPoint>& points) {
  // Names in order of first appearance; a name's index picks its style.
  std::vector<std::string> panels, series, color_keys, dash_keys;
  auto index_in = [](std::vector<std::string>& names, const std::string& name) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) it = names.insert(names.end(), name);
    return static_cast<size_t>(it - names.begin());
  };
  std::vector<size_t> color_of, dash_of;  // per series
  for (const PlotPoint& p : points) {
    index_in(panels, p.panel);
    if (index_in(series, p.series) == color_of.size()) {
      color_of.push_back(index_in(color_keys, p.color_key.empty() ? p.series : p.color_key));
      dash_of.push_back(index_in(dash_keys, p.dash_key));
    }
  }
  auto color = [&](size_t i) { return kColors[color_of[i] % std::size(kColors)]; };
  auto dash = [&](size_t i) { return kDashes[(dash_of[i] + color_of[i] / std::size(kColors)) % std::size(kDashes)]; };
  auto index_of = [&](const std::string& s) { return index_in(series, s); };

  const double width = std::max<double>(1, panels.size()) * kPanelW + kLegendW;
  const double height = std::max(kPanelH, kTop + 10 + kRowH * static_cast<double>(series.size()));
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" << esc(title) << "</text>\n";

  for (size_t pi = 0; pi < panels.size(); ++pi) {
    std::vector<const PlotPoint*> mine;
    for (const PlotPoint& p : points)
      if (p.panel == panels[pi] && p.x > 0 && p.y > 0) mine.push_back(&p);
    if (mine.empty()) continue;
    auto [xmin, xmax] = std::minmax_element(mine.begin(), mine.end(), [](auto* a, auto* b) { return a->x < b->x; });
    auto [ymin, ymax] = std::minmax_element(mine.begin(), mine.end(), [](auto* a, auto* b) { return a->y < b->y; });
    const double ox = static_cast<double>(pi) * kPanelW;
    const double l = ox + kLeft, r = ox + kPanelW - kRight, t = kTop, b = kPanelH - kBottom;
    const LogAxis ax((*xmin)->x, (*xmax)->x, l, r), ay((*ymin)->y, (*ymax)->y, b, t);

    s << "<text x=\"" << (l + r) / 2 << "\" y=\"" << t - 8 << "\" text-anchor=\"middle\" font-size=\"13\">"
      << esc(panels[pi]) << "</text>\n";
    // Grid and tick labels: x at the measured values, y at 1-2-5 steps.
    std::vector<double> xs;
    for (auto* p : mine) xs.push_back(p->x);
    std::sort(xs.begin(), xs.end());
    xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
    for (double x : xs)
      s << "<line x1=\"" << ax.px(x) << "\" y1=\"" << t << "\" x2=\"" << ax.px(x) << "\" y2=\"" << b
        << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << ax.px(x) << "\" y=\"" << b + 14
        << "\" text-anchor=\"middle\">" << num(x) << "</text>\n";
    for (double y : ay.ticks())
      s << "<line x1=\"" << l << "\" y1=\"" << ay.px(y) << "\" x2=\"" << r << "\" y2=\"" << ay.px(y)
        << "\" stroke=\"#e5e5e5\"/>\n<text x=\"" << l - 4 << "\" y=\"" << ay.px(y) + 4
        << "\" text-anchor=\"end\">" << num(y) << "</text>\n";
    s << "<rect x=\"" << l << "\" y=\"" << t << "\" width=\"" << r - l << "\" height=\"" << b - t
      << "\" fill=\"none\" stroke=\"black\"/>\n"
      << "<text x=\"" << (l + r) / 2 << "\" y=\"" << b + 30 << "\" text-anchor=\"middle\">" << esc(x_label)
      << " (log)</text>\n"
      << "<text transform=\"translate(" << ox + 16 << "," << (t + b) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">" << esc(y_label) << " (log)</text>\n";

    std::map<size_t, std::vector<const PlotPoint*>> lines;
    for (auto* p : mine) lines[index_of(p->series)].push_back(p);
    for (auto& [i, pts] : lines) {
      std::sort(pts.begin(), pts.end(), [](auto* a, auto* c) { return a->x < c->x; });
      s << "<polyline fill=\"none\" stroke=\"" << color(i) << "\" stroke-width=\"1.6\" stroke-dasharray=\""
        << dash(i) << "\" points=\"";
      for (auto* p : pts) s << ax.px(p->x) << "," << ay.px(p->y) << " ";
      s << "\"/>\n";
      for (auto* p : pts)
        s << "<circle cx=\"" << ax.px(p->x) << "\" cy=\"" << ay.px(p->y) << "\" r=\"2.5\" fill=\"" << color(i)
          << "\"><title>" << esc(p->series) << ": " << num(p->y) << "</title></circle>\n";
    }
  }

  const double lx = static_cast<double>(panels.size()) * kPanelW + 10;
  s << "<text x=\"" << lx << "\" y=\"" << kTop - 8 << "\" font-weight=\"bold\">legend</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const double y = kTop + kRowH * static_cast<double>(i) + 4;
    s << "<line x1=\"" << lx << "\" y1=\"" << y << "\" x2=\"" << lx + 26 << "\" y2=\"" << y << "\" stroke=\""
      << color(i) << "\" stroke-width=\"1.6\" stroke-dasharray=\"" << dash(i) << "\"/>\n<text x=\"" << lx + 32
      << "\" y=\"" << y + 4 << "\">" << esc(series[i]) << "</text>\n";
  }
  s << "</svg>\n";

  std::ofstream f(path);
  f << s.str();
  if (!f) throw Error("cannot write " + path);
}

}  // namespace dimattn::cli
