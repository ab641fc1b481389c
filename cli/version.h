#ifndef SHOAL_VERSION_H
#define SHOAL_VERSION_H
#define SHOAL_VERSION "0.1.0"
#endif
