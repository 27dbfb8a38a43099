#pragma once
// The subcommands of `dimattn`. Each parses argv[first..] itself and returns
// the exit status; bad arguments throw UsageError (cli_args.h).
#include <string>
#include <vector>

namespace dimattn::cli {

int run_bench(int argc, char** argv, int first);
int run_explain(int argc, char** argv, int first);
int run_check(int argc, char** argv, int first);
int run_example(int argc, char** argv, int first);

// One point of a line in an SVG chart: panels side by side, one line per
// series. Series with the same color key share a color; with the same dash
// key, a dash pattern.
struct PlotPoint {
  std::string panel, series;
  double x, y;
  std::string color_key, dash_key;
};
// Writes a log-log chart (y against x) of each series, one panel per distinct
// panel name in order of appearance. Throws dimattn::Error when the file cannot be written.
void write_svg_plot(const std::string& path, const std::string& title, const std::string& x_label,
                    const std::string& y_label, const std::vector<PlotPoint>& points);

}  // namespace dimattn::cli
