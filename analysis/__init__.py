"""vitlab analyses: measurements on any model the taps understand, at training time or offline."""
