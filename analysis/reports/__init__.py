"""Reports from analysed runs: a run report, side-by-side comparisons, study claims and the study command."""
